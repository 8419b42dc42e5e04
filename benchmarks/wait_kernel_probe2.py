import sys, time, torch
from kvbm_client.signal_page import EngineSignals
torch.cuda.init()
signals = EngineSignals()
print("enable", signals.enable_gpu(0))
signal = signals.take(8)
x = torch.ones(1 << 20, device="cuda")
stream = torch.cuda.Stream()
done = torch.cuda.Event()
mark = torch.cuda.Event()
with torch.cuda.stream(stream):
    signals.wait(signal, 5, stream.cuda_stream, float(sys.argv[1]))
    mark.record(stream)
    y = x * 2
    done.record(stream)
time.sleep(0.2)
print("after 0.2 s: mark", mark.query(), "done", done.query(), "word", int(signals.words[signal.slot]), signal)
signals.words[signal.slot] = signal.base + 5
torch.cuda.synchronize()
print("seen", signals._seen[:2].tolist(), "y", float(y[0]))
stream2 = torch.cuda.Stream()
e2 = torch.cuda.Event()
signals.wait(signal, 6, stream2.cuda_stream, float(sys.argv[1]))
e2.record(stream2)
time.sleep(0.2)
print("outside with: done", e2.query())
t0 = time.monotonic()
signals.words[signal.slot] = signal.base + 6
torch.cuda.synchronize()
print("second released after", round(time.monotonic() - t0, 3), "s; seen", signals._seen[:2].tolist(), "word", int(signals.words[signal.slot]))
