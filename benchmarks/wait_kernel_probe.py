"""Does the signal page's wait kernel (kvbm_client/signal_page.py) hold its stream until its word
is written, when the kernel after it on the stream was never launched before in the process?

    CUDA_MODULE_LOADING=LAZY  python3 benchmarks/wait_kernel_probe.py plain|no_mul
    CUDA_MODULE_LOADING=EAGER python3 benchmarks/wait_kernel_probe.py plain

One process per line (the loading mode is fixed when CUDA starts; ``enable_gpu`` refuses GPU
waits under lazy loading, so the probe forces them on). ``plain``: the wait, then ``x * 2`` (a
kernel loaded only now, under lazy loading) on the same stream; ``no_mul``: the wait alone. The
word is written 0.2 s after the launches by another thread, as the daemon (another process)
writes it, independently of the engine's thread. Prints whether the stream passed the wait
before its word was written (checked by the writer right before it writes), how long the
launches held the launching thread, what the wait kernel read last and how long it waited.

Measured 2026-11-26 (sixth session) on an H200 VM (driver 580, torch 2.11+cu130), with an
earlier version of this probe that wrote the word from the launching thread itself: LAZY plain:
"passed early", the kernel read 0 until its 2 s limit; LAZY no_mul and EAGER plain: held, released
on the word. Read again (seventh session): that was the documented lazy-loading hazard (loading a
kernel's module may need a context synchronization, which waits for the spinning wait kernel),
so the launch of ``x * 2`` held the launching thread until the wait kernel gave up at its limit,
and the word, written by that same thread afterwards, came too late: a self-deadlock of the probe
broken by the limit, not a stream passing its wait. With the word written by someone else (the
daemon, in kvbm) the launch would only wait for the word. This version tests that; not run yet
(no device time was left). Until it has run (and vLLM with GPU waits under lazy loading has been
checked), GPU layer waits stay limited to CUDA_MODULE_LOADING=EAGER.
"""
import sys
import time

import torch

from kvbm_client.signal_page import EngineSignals

variant = sys.argv[1] if len(sys.argv) > 1 else "plain"
torch.cuda.init()
signals = EngineSignals()
why = signals.enable_gpu(0)
if why is not None and "EAGER" in why:  # force them on under lazy loading, to show why they are off
    from kvbm_client.signal_page import _wait_kernel
    from cuda.bindings import driver, runtime
    addr = int(signals.words.ctypes.data)
    runtime.cudaHostRegister(addr, 4096, runtime.cudaHostRegisterMapped | runtime.cudaHostRegisterPortable)
    signals.device_ptr, signals._driver = int(runtime.cudaHostGetDevicePointer(addr, 0)[1]), driver
    signals._image, signals._module, signals._kernel = _wait_kernel(driver, 0)
    signals._seen = torch.zeros(2 * 1024, dtype=torch.int64, device="cuda")
elif why is not None:
    raise SystemExit(why)
signal = signals.take(8)
x = torch.ones(1 << 20, device="cuda")
stream = torch.cuda.Stream()
mark = torch.cuda.Event()
seen: dict[str, object] = {}


def writer() -> None:  # the daemon's part: the word, 0.2 s after the launches began
    time.sleep(0.2)
    seen["early"] = mark.query()  # (the launching thread may still be held in a lazy load)
    signals.words[signal.slot] = signal.base + 5


import threading  # noqa: E402

thread = threading.Thread(target=writer)
t0 = time.monotonic()
thread.start()
with torch.cuda.stream(stream):
    signals.wait(signal, 5, stream.cuda_stream, 2.0)
    mark.record(stream)
    if variant != "no_mul":
        y = x * 2
held = time.monotonic() - t0
thread.join()
torch.cuda.synchronize()
print(variant, "passed early:", seen["early"], "launches held the thread s:", round(held, 3),
      "read last:", int(signals._seen[0]), "waited ns:", int(signals._seen[1]), "(written:", signal.base + 5, ")",
      flush=True)
