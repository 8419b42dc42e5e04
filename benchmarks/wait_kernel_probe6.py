import ctypes, time, torch
from cuda.bindings import driver as d
from kvbm_client.signal_page import EngineSignals
torch.cuda.init()
signals = EngineSignals(); print("enable", signals.enable_gpu(0))
for way in ("wait() in with", "wait() in with, x before", "wait()"):
    sig = signals.take(8)
    s = torch.cuda.Stream(); ev = torch.cuda.Event()
    if "x before" in way:
        x = torch.ones(1 << 20, device="cuda")
    if "with" in way:
        with torch.cuda.stream(s):
            signals.wait(sig, 5, s.cuda_stream, 3.0)
            ev.record(s)
    else:
        signals.wait(sig, 5, s.cuda_stream, 3.0)
        ev.record(s)
    time.sleep(0.2)
    q = ev.query()
    signals.words[sig.slot] = sig.base + 5
    torch.cuda.synchronize()
    print(way, "slot", sig.slot, "passed early:", q, "seen", signals._seen[2 * sig.slot:2 * sig.slot + 2].tolist())
