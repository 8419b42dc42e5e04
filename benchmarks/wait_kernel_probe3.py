import ctypes, time
import torch
from cuda.bindings import driver as d, nvrtc
from kvbm_client.signal_page import EngineSignals, WAIT_KERNEL
torch.cuda.init()
sig = EngineSignals(); print("enable", sig.enable_gpu(0))
src = WAIT_KERNEL.replace("kvbm_wait_word", "dbg").replace("unsigned long long max_ns) {", "unsigned long long max_ns, unsigned long long* out) {\n int it = 0;").replace("__nanosleep(2000);", "__nanosleep(2000); it++; out[0] = value; out[1] = it; out[2] = now - start;")
err, prog = nvrtc.nvrtcCreateProgram(src.encode(), b"d.cu", 0, [], [])
print(nvrtc.nvrtcCompileProgram(prog, 1, [b"--gpu-architecture=compute_90"]))
_, n = nvrtc.nvrtcGetPTXSize(prog); ptx = b" " * n; nvrtc.nvrtcGetPTX(prog, ptx)
err, mod = d.cuModuleLoadData(ptx); err, fn = d.cuModuleGetFunction(mod, b"dbg")
out = torch.zeros(8, dtype=torch.int64, device="cuda")
for trial in range(2):
    t = sig.take(8)
    s = torch.cuda.Stream(); ev = torch.cuda.Event()
    args = ((sig.device_ptr + 4 * t.slot, t.base + 5, int(5e9), out.data_ptr()),
            (ctypes.c_void_p, ctypes.c_uint, ctypes.c_ulonglong, ctypes.c_void_p))
    print("launch", d.cuLaunchKernel(fn, 1, 1, 1, 1, 1, 1, 0, d.CUstream(s.cuda_stream), args, 0))
    ev.record(s)
    time.sleep(1.0)
    print("after 1 s", ev.query(), "word", int(sig.words[t.slot]), "target", t.base + 5)
    t0 = time.monotonic(); sig.words[t.slot] = t.base + 5
    while not ev.query() and time.monotonic() - t0 < 8: time.sleep(0.0005)
    print("released after", round((time.monotonic() - t0) * 1e3, 2), "ms", out.tolist()[:3])
# the real wait(): same
t = sig.take(8); s = torch.cuda.Stream(); ev = torch.cuda.Event()
sig.wait(t, 5, s.cuda_stream, 5.0); ev.record(s); time.sleep(1.0)
print("wait(): after 1 s", ev.query()); t0 = time.monotonic(); sig.words[t.slot] = t.base + 5
while not ev.query() and time.monotonic() - t0 < 8: time.sleep(0.0005)
print("wait(): released after", round((time.monotonic() - t0) * 1e3, 2), "ms")
torch.cuda.synchronize()
