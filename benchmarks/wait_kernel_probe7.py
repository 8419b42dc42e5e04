import os, sys, time, torch
from kvbm_client.signal_page import EngineSignals
variant = sys.argv[1]
torch.cuda.init()
signals = EngineSignals(); assert signals.enable_gpu(0) is None
if variant == "sync_after_enable":
    torch.cuda.synchronize()
signal = signals.take(8)
if variant == "stream_first":
    stream = torch.cuda.Stream()
x = torch.ones(1 << 20, device="cuda")
if variant != "stream_first":
    stream = torch.cuda.Stream()
mark = torch.cuda.Event()
with torch.cuda.stream(stream):
    signals.wait(signal, 5, stream.cuda_stream, 2.0)
    mark.record(stream)
    if variant != "no_mul":
        y = x * 2
time.sleep(0.2)
early = mark.query()
signals.words[signal.slot] = signal.base + 5
t0 = time.monotonic(); torch.cuda.synchronize()
print(variant, "passed early:", early, "seen", signals._seen[:2].tolist(), "sync", round(time.monotonic() - t0, 2), "s", flush=True)
