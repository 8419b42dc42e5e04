"""Does a CUDA stream wait (cuStreamWaitValue32) on a word of host memory see a CPU store, and a
stream write from another stream? Probes the ways the signal page could be mapped. Never blocks:
polls events, and releases every wait at the end (CPU store and a stream write).

    python3 benchmarks/stream_wait_probe.py

Measured 2026-11-26 (sixth session) on an H200 VM (driver 580, cuda-bindings 13.3.1,
CAN_USE_STREAM_MEM_OPS_V1 = 0): the first trial's cuStreamWaitValue32 returned in 0.4 ms, and
the next kernel launch on that stream hung the launching thread (faulthandler's dump after
25 s); so kvbm's GPU layer waits use a polling kernel and 4-byte DMA writes instead.
"""
from __future__ import annotations

import json
import mmap
import os
import time

import numpy as np
import torch
from cuda.bindings import driver as d, runtime as rt

import faulthandler
import sys
faulthandler.dump_traceback_later(25, exit=True)
torch.cuda.init()
dev = torch.device("cuda:0")
x = torch.ones(1 << 16, device=dev)


def poll(event, seconds):
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if event.query():
            return True
        time.sleep(0.001)
    return event.query()


def trial(name, host_view, dptr, flags=d.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ, writer="cpu"):
    print("trial", name, writer, flush=True)
    host_view[0] = 0
    s = torch.cuda.Stream(dev)
    ev = torch.cuda.Event()
    t = time.perf_counter()
    err = d.cuStreamWaitValue32(d.CUstream(s.cuda_stream), d.CUdeviceptr(dptr), 5, flags)[0]
    print("  wait call returned", err, round((time.perf_counter() - t) * 1e3, 3), "ms", flush=True)
    with torch.cuda.stream(s):
        _ = x * 2
        ev.record(s)
    early = poll(ev, 0.1)
    if writer == "cpu":
        host_view[0] = 5
    else:
        w = torch.cuda.Stream(dev)
        werr = d.cuStreamWriteValue32(d.CUstream(w.cuda_stream), d.CUdeviceptr(dptr), 5,
                                      d.CUstreamWriteValue_flags.CU_STREAM_WRITE_VALUE_DEFAULT)[0]
        err = f"{err} / write {werr}"
    released = poll(ev, 2.0)
    if not released:  # unblock it whatever way works
        host_view[0] = 7
        w = torch.cuda.Stream(dev)
        d.cuStreamWriteValue32(d.CUstream(w.cuda_stream), d.CUdeviceptr(dptr), 9, 0)
        released_late = poll(ev, 2.0)
    else:
        released_late = None
    row = {"way": name, "writer": writer, "err": str(err), "ran_early": early, "released": released,
           "released_by_fallback": released_late}
    print(json.dumps(row), flush=True)
    return row


rows = []
# 3. device memory written by a stream
dm = torch.zeros(1024, dtype=torch.int32, device=dev)
class DV:
    def __setitem__(self, i, v):
        dm[i] = v
rows.append(trial("device memory", DV(), dm.data_ptr(), writer="stream"))
# 1. memfd, MAP_SHARED, cudaHostRegister(Mapped|Portable)
fd = os.memfd_create("probe", os.MFD_CLOEXEC)
os.ftruncate(fd, 4096)
m = mmap.mmap(fd, 4096, flags=mmap.MAP_SHARED)
w = np.frombuffer(m, dtype="<u4")
addr = int(w.ctypes.data)
print(rt.cudaHostRegister(addr, 4096, rt.cudaHostRegisterMapped | rt.cudaHostRegisterPortable))
err, dp = rt.cudaHostGetDevicePointer(addr, 0)
print("memfd devptr", err, hex(int(dp)), hex(addr))
rows.append(trial("memfd registered", w, int(dp)))
rows.append(trial("memfd registered, FLUSH", w, int(dp),
                  d.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ | d.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_FLUSH))
rows.append(trial("memfd registered", w, int(dp), writer="stream"))
# 2. cudaHostAlloc mapped
err, hp = rt.cudaHostAlloc(4096, rt.cudaHostAllocMapped | rt.cudaHostAllocPortable)
import ctypes
hv = np.ctypeslib.as_array((ctypes.c_uint32 * 1024).from_address(int(hp)))
err, dp2 = rt.cudaHostGetDevicePointer(int(hp), 0)
rows.append(trial("cudaHostAlloc mapped", hv, int(dp2)))
print(json.dumps({"attrs": {a: d.cuDeviceGetAttribute(getattr(d.CUdevice_attribute, a), 0)[1] for a in (
    "CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_MEM_OPS_V1", "CU_DEVICE_ATTRIBUTE_CAN_FLUSH_REMOTE_WRITES",
    "CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM") if hasattr(d.CUdevice_attribute, a)}}))
torch.cuda.synchronize()
