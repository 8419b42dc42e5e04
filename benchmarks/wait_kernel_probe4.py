import ctypes, sys, time, torch
from cuda.bindings import driver as d, nvrtc
from kvbm_client.signal_page import EngineSignals, WAIT_KERNEL
torch.cuda.init()
signals = EngineSignals(); print("enable", signals.enable_gpu(0))
src = WAIT_KERNEL.replace("kvbm_wait_word", "dbg").replace("unsigned long long max_ns) {", "unsigned long long max_ns, unsigned long long* out) {\n int it = 0; out[3] = 77;").replace("__nanosleep(2000);", "__nanosleep(2000); it++; out[0] = value; out[1] = it; out[2] = now - start;")
src = src.replace("    }\n}", "    }\n    out[4] = value; out[5] = it; out[6] = 99;\n}")
err, prog = nvrtc.nvrtcCreateProgram(src.encode(), b"d.cu", 0, [], [])
print(nvrtc.nvrtcCompileProgram(prog, 1, [b"--gpu-architecture=compute_90"]))
_, n = nvrtc.nvrtcGetPTXSize(prog); ptx = b" " * n; nvrtc.nvrtcGetPTX(prog, ptx)
err, mod = d.cuModuleLoadData(ptx); err, fn = d.cuModuleGetFunction(mod, b"dbg")
out = torch.zeros(8, dtype=torch.int64, device="cuda")
signal = signals.take(8)
x = torch.ones(1 << 20, device="cuda")
stream = torch.cuda.Stream()
mark = torch.cuda.Event()
print("word ptr", hex(signals.device_ptr + 4 * signal.slot), "host", hex(int(signals.words.ctypes.data)))
with torch.cuda.stream(stream):
    args = ((signals.device_ptr + 4 * signal.slot, signal.base + 5, int(5e9), out.data_ptr()),
            (ctypes.c_void_p, ctypes.c_uint, ctypes.c_ulonglong, ctypes.c_void_p))
    print("launch", d.cuLaunchKernel(fn, 1, 1, 1, 1, 1, 1, 0, d.CUstream(stream.cuda_stream), args, 0))
    mark.record(stream)
time.sleep(0.2)
print("after 0.2 s: mark", mark.query(), "word", int(signals.words[signal.slot]))
signals.words[signal.slot] = signal.base + 5
torch.cuda.synchronize()
print("out", out.tolist())
