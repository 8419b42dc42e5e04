"""Does the signal page's wait kernel (kvbm_client/signal_page.py) hold its stream until its word
is written, when the kernel after it on the stream was never launched before in the process?

    CUDA_MODULE_LOADING=LAZY  python3 benchmarks/wait_kernel_probe.py plain|no_mul
    CUDA_MODULE_LOADING=EAGER python3 benchmarks/wait_kernel_probe.py plain

One process per line (the loading mode is fixed when CUDA starts; the probe enables GPU waits
with ``lazy_loading=True``, as ``gpu_layer_waits: true`` does). ``plain``: the wait, a 4-byte
device -> host copy of a "done" word into the signal page, then ``x * 2`` (a kernel loaded only
now, under lazy loading) on the same stream; ``no_mul``: without ``x * 2``. The word is written
0.2 s after the launches began by another *process* (as the daemon writes it: neither the
launching thread nor the interpreter lock it may hold in a launch can delay it), which first
reads the "done" word: set means the stream passed the wait before its word was written. Prints
that, how long the launches held the launching thread, what the wait kernel read last and how
long it waited (a wait that ran into its 2 s limit read less than the word's value).

Measured 2026-11-26 (eighth session) on an H200 VM (driver 580, torch 2.11+cu130, commit d8a6074;
``results/wait_probes_h200_2026-11-26k.txt``): LAZY plain: not passed early, the launches held the
thread 0.201 s (the lazy load of ``x * 2`` waited for the spinning wait), the wait read its word
after 0.1999 s; LAZY no_mul and EAGER plain: not passed early, held 0.000 / 0.001 s, released on
the word. So the stream's order holds under lazy loading; what lazy loading costs is a held
launching thread while a wait spins. ``tests/gpu/test_daemon_gpu.py`` runs this probe as a test.

The sixth session's version wrote the word from the launching thread itself and saw LAZY plain
"pass early" with the kernel reading 0 until its 2 s limit: the launch of ``x * 2`` held that
thread until the wait gave up, so the word came too late (a self-deadlock of the probe, not a
stream passing its wait). The seventh session's version wrote it from another thread, which
would again need the interpreter lock that a launch held from Python keeps.
"""
import json
import subprocess
import sys
import time

import torch
from cuda.bindings import runtime

from kvbm_client.signal_page import EngineSignals

WRITER = """
import json, mmap, struct, sys, time
fd, slot, value, done_slot, delay = (int(a) for a in sys.argv[1:6])
page = mmap.mmap(fd, 4096, flags=mmap.MAP_SHARED)
print("ready", flush=True)
sys.stdin.readline()  # the launches begin
time.sleep(delay / 1000)
done = struct.unpack_from("<I", page, 4 * done_slot)[0]
struct.pack_into("<I", page, 4 * slot, value)
print(json.dumps({"done_before_word": done}), flush=True)
"""

variant = sys.argv[1] if len(sys.argv) > 1 else "plain"
torch.cuda.init()
signals = EngineSignals()
why = signals.enable_gpu(0, lazy_loading=True)
if why is not None:
    raise SystemExit(why)
signal, done = signals.take(8), signals.take(8)
signals.words[done.slot] = 0
one = torch.ones(1, dtype=torch.int32, device="cuda")
x = torch.ones(1 << 20, device="cuda")
stream = torch.cuda.Stream()
torch.cuda.synchronize()
writer = subprocess.Popen([sys.executable, "-c", WRITER, str(signals.fd), str(signal.slot), str(signal.base + 5),
                           str(done.slot), "200"], pass_fds=(signals.fd,), stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, text=True)
assert writer.stdout is not None and writer.stdin is not None
assert writer.stdout.readline().strip() == "ready"
writer.stdin.write("go\n")
writer.stdin.flush()
t0 = time.monotonic()
with torch.cuda.stream(stream):
    signals.wait(signal, 5, stream.cuda_stream, 2.0)
    err = runtime.cudaMemcpyAsync(int(signals.words.ctypes.data) + 4 * done.slot, one.data_ptr(), 4,
                                  runtime.cudaMemcpyKind.cudaMemcpyDefault, stream.cuda_stream)[0]
    assert err == runtime.cudaError_t.cudaSuccess, err
    if variant != "no_mul":
        y = x * 2
held = time.monotonic() - t0
report = json.loads(writer.stdout.readline())
writer.wait(10)
torch.cuda.synchronize()
print(json.dumps({"variant": variant, "loading": __import__("os").environ.get("CUDA_MODULE_LOADING", "(default)"),
                  "passed_early": bool(report["done_before_word"]), "launches_held_thread_s": round(held, 3),
                  "read_last": int(signals._seen[2 * signal.slot]), "word": signal.base + 5,
                  "waited_ns": int(signals._seen[2 * signal.slot + 1]),
                  "done_after": int(signals.words[done.slot])}), flush=True)
