"""Does the signal page's wait kernel (kvbm_client/signal_page.py) hold its stream until its word
is written, when the kernel after it on the stream was never launched before in the process?

    CUDA_MODULE_LOADING=LAZY  python3 benchmarks/wait_kernel_probe.py plain|no_mul
    CUDA_MODULE_LOADING=EAGER python3 benchmarks/wait_kernel_probe.py plain

One process per line (the loading mode is fixed when CUDA starts; ``enable_gpu`` refuses GPU
waits under lazy loading, so the probe forces them on). ``plain``: the wait, then ``x * 2`` (a
kernel loaded only now, under lazy loading) on the same stream; ``no_mul``: the wait alone.
Prints whether the stream passed the wait before its word was written (0.2 s later), what the
wait kernel read last and how long it waited.

Measured 2026-11-26 (sixth session) on an H200 VM (driver 580, torch 2.11+cu130): LAZY plain:
passed early, the kernel read 0 until its 2 s limit although the word was written at 0.2 s;
LAZY no_mul and EAGER plain: held, released on the word (it read 1029, the value written).
Hence GPU layer waits need CUDA_MODULE_LOADING=EAGER.
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
with torch.cuda.stream(stream):
    signals.wait(signal, 5, stream.cuda_stream, 2.0)
    mark.record(stream)
    if variant != "no_mul":
        y = x * 2
time.sleep(0.2)
early = mark.query()
signals.words[signal.slot] = signal.base + 5
torch.cuda.synchronize()
print(variant, "passed early:", early, "read last:", int(signals._seen[0]), "waited ns:", int(signals._seen[1]),
      "(written:", signal.base + 5, ")", flush=True)
