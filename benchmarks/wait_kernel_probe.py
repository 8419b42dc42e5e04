"""Debug probe of the signal page's wait kernel: what it read, for how long, on which stream."""
import ctypes, time, json
import torch
from cuda.bindings import driver as d, nvrtc
from kvbm_client.signal_page import EngineSignals, WAIT_KERNEL, Signal
torch.cuda.init()
sig = EngineSignals()
print("enable", sig.enable_gpu(0), hex(sig.device_ptr or 0), hex(int(sig.words.ctypes.data)))
src = WAIT_KERNEL.replace("kvbm_wait_word", "dbg").replace("unsigned long long max_ns) {", "unsigned long long max_ns, unsigned long long* out) {\n out[0] = *word; out[1] = target; out[2] = max_ns; int it = 0;").replace("__nanosleep(2000);", "__nanosleep(2000); it++;").replace("\n    }\n}", "\n    }\n out[3] = it; out[4] = *word; out[5] = now - start;\n}")
print(src)
err, major = d.cuDeviceGetAttribute(d.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, 0)
err, prog = nvrtc.nvrtcCreateProgram(src.encode(), b"d.cu", 0, [], [])
print(nvrtc.nvrtcCompileProgram(prog, 1, [b"--gpu-architecture=compute_90"]))
_, n = nvrtc.nvrtcGetPTXSize(prog); ptx = b" " * n; nvrtc.nvrtcGetPTX(prog, ptx)
err, mod = d.cuModuleLoadData(ptx); err, fn = d.cuModuleGetFunction(mod, b"dbg")
out = torch.zeros(8, dtype=torch.int64, device="cuda")
s = torch.cuda.Stream()
ev = torch.cuda.Event()
t = sig.take(8)
print("signal", t, int(sig.words[t.slot]))
args = ((sig.device_ptr + 4 * t.slot, t.base + 5, int(3e9), out.data_ptr()),
        (ctypes.c_void_p, ctypes.c_uint, ctypes.c_ulonglong, ctypes.c_void_p))
print("launch", d.cuLaunchKernel(fn, 1, 1, 1, 1, 1, 1, 0, d.CUstream(s.cuda_stream), args, 0))
ev.record(s)
t0 = time.monotonic()
while not ev.query() and time.monotonic() - t0 < 10:
    time.sleep(0.001)
print("done after", round(time.monotonic() - t0, 3), "s", out.tolist())
sig.words[t.slot] = t.base + 5
torch.cuda.synchronize()
