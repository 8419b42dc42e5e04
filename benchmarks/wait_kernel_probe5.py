import ctypes, time, torch
from cuda.bindings import driver as d
from kvbm_client.signal_page import EngineSignals
torch.cuda.init()
signals = EngineSignals(); print("enable", signals.enable_gpu(0))
for way in ("direct", "wait()"):
    sig = signals.take(8)
    s = torch.cuda.Stream(); ev = torch.cuda.Event()
    if way == "direct":
        args = ((signals.device_ptr + 4 * sig.slot, sig.base + 5, int(3e9), signals._seen.data_ptr() + 16 * sig.slot),
                (ctypes.c_void_p, ctypes.c_ulonglong, ctypes.c_ulonglong, ctypes.c_void_p))
        print(d.cuLaunchKernel(signals._kernel, 1, 1, 1, 1, 1, 1, 0, d.CUstream(s.cuda_stream), args, 0))
    else:
        signals.wait(sig, 5, s.cuda_stream, 3.0)
    ev.record(s)
    time.sleep(0.2)
    q = ev.query()
    signals.words[sig.slot] = sig.base + 5
    torch.cuda.synchronize()
    print(way, "slot", sig.slot, "passed early:", q, "seen", signals._seen[2 * sig.slot:2 * sig.slot + 2].tolist())
