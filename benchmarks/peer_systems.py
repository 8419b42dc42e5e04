"""The systems of the vLLM peers harness (``vllm_peers.py``): each one's engine kwargs and
environment (:func:`system_kwargs`), kvbm's variants (:data:`OURS`), and the connectors whose layer
hooks need PIECEWISE CUDA graphs (:data:`LAYER_HOOKS`).
"""
import json
import os

#: systems whose connector does work in vLLM's per-layer hooks (wait_for_layer_load / save_kv_layer)
#: without declaring requires_piecewise_for_cudagraph (vLLM 0.26 then keeps FULL graphs, whose
#: replays skip the hooks): under --cuda-graphs they get PIECEWISE graphs. Dynamo KVBM 1.6.1's
#: save_kv_layer records a CUDA event per layer; the native connector's hooks are no-ops. kvbm's
#: wait only under load_mode layerwise ("ours_layerwise") and only in steps that load, which are
#: never uniform decode batches (FULL graphs): it keeps FULL_AND_PIECEWISE since 2026-11-27
#: (twenty-second session; PIECEWISE before). LMCache declares PIECEWISE when layerwise (not here).
LAYER_HOOKS = ("dynamo",)
#: kvbm's variants: the connector's kv_connector_extra_config over its defaults ("ours": load_mode
#: auto, early loads on where safe); ours_layerwise_noearly: the worker role starts every load (A/B);
#: ours_layerwise_cpuwait: the forward's layer waits on the CPU, as before GPU layer waits (A/B);
#: ours_layerwise_gpuwait: the layer waits on the GPU whatever CUDA's module loading (lazy here;
#: gpu_layer_waits true) (A/B); ours_layerwise_eager: gpu_layer_waits "eager", the default until
#: 2026-11-26 (tenth session), which keeps them on the CPU under lazy loading (A/B);
#: ours_layerwise_tail: only the last layers' waits on the GPU (gpu_layer_waits tail, the default
#: since then: the same as ours_layerwise, kept so that older runbook steps still run);
#: ours_layerwise_g4 / _g3: layer-pipelined loads in 4 / 3 layer groups instead of 6 (A/B);
#: ours_layerwise_syncstore: each step's PrepareStore on vLLM's scheduler thread, its stores
#: shipped with that step (async_store_plans false: the behaviour until 2026-11-26's eleventh session) (A/B);
#: ours_layerwise_perlayer: vLLM's per-layer KV tensors instead of one cross-layer buffer (A/B)
#: ours_layerwise_nofilter: every lookup asks the leader, as before the twelfth session's presence
#: filter (presence_filter false) (A/B)
#: ours_layerwise_nostore: no block offloaded (store_blocks false; so no hit either): what the stores
#: cost a cold request (A/B)
#: ours_layerwise_delayfree: a finished request keeps all its blocks until its stores are done
#: (hold_stored_blocks false: the behaviour before 2026-11-27) (A/B)
#: ours_layerwise_afterfirst: the layer waits after the daemon's first layer group on the GPU
#: (gpu_layer_waits after_first; the default, tail, only the last layers') (A/B)
#: ours_layerwise_decodeplans / ours_decodeplans: a step that loads nothing (decode) plans its stores
#: off vLLM's scheduler thread whatever their number (async_decode_store_plans true, the default since
#: 2026-11-27's twenty-third session; the same as ours_layerwise / ours since) (A/B);
#: ours_layerwise_decodesync: such steps plan on that thread below async_store_min_blocks (the
#: behaviour before) (A/B)
#: ours_layerwise_staged: each hit staged on the worker at its lookup, sent by the leader since the
#: twenty-fifth session (staged_loads true; the worker needs --stage-mib, e.g.
#: KVBM_WORKER_ARGS="--stage-mib 1024"), against ours_layerwise_unstaged (staged_loads false) (A/B).
#: staged_loads is on by default since the twenty-fifth session (it stages on the workers that have
#: an area), so ours_layerwise stages too where the workers have one; before, ours_layerwise was the
#: unstaged side of this A/B
OURS = {"ours": {}, "ours_sync": {"load_mode": "sync"}, "ours_async": {"load_mode": "async"},
        "ours_layerwise": {"load_mode": "layerwise"},
        "ours_layerwise_noearly": {"load_mode": "layerwise", "early_loads": False},
        "ours_layerwise_cpuwait": {"load_mode": "layerwise", "gpu_layer_waits": False},
        "ours_layerwise_gpuwait": {"load_mode": "layerwise", "gpu_layer_waits": True},
        "ours_layerwise_tail": {"load_mode": "layerwise", "gpu_layer_waits": "tail"},
        "ours_layerwise_eager": {"load_mode": "layerwise", "gpu_layer_waits": "eager"},
        "ours_layerwise_g4": {"load_mode": "layerwise", "layer_groups": 4},
        "ours_layerwise_g3": {"load_mode": "layerwise", "layer_groups": 3},
        "ours_layerwise_syncstore": {"load_mode": "layerwise", "async_store_plans": False},
        "ours_layerwise_perlayer": {"load_mode": "layerwise", "cross_layer_blocks": False},
        "ours_layerwise_nofilter": {"load_mode": "layerwise", "presence_filter": False},
        "ours_layerwise_nostore": {"load_mode": "layerwise", "store_blocks": False},
        "ours_layerwise_delayfree": {"load_mode": "layerwise", "hold_stored_blocks": False},
        "ours_layerwise_afterfirst": {"load_mode": "layerwise", "gpu_layer_waits": "after_first"},
        "ours_layerwise_decodeplans": {"load_mode": "layerwise", "async_decode_store_plans": True},
        "ours_decodeplans": {"async_decode_store_plans": True},
        "ours_layerwise_decodesync": {"load_mode": "layerwise", "async_decode_store_plans": False},
        "ours_layerwise_staged": {"load_mode": "layerwise", "staged_loads": True},
        "ours_layerwise_unstaged": {"load_mode": "layerwise", "staged_loads": False}}
#: a system's name ending in this runs it under vLLM's V1 model runner (VLLM_USE_V2_MODEL_RUNNER=0)
#: one step at a time (async_scheduling False: where the V1 runner recomputes a failed same-step load
#: correctly; under async scheduling it killed the engine, compat.default_load_mode). vLLM 0.26 runs
#: Qwen3 on its V2 runner, which ignores the connector's prefer_cross_layer_blocks (a KV allocation
#: per layer: a copy per page); the V1 runner allocates one cross-layer buffer (2026-11-27,
#: twenty-first session: lmcache_v1, ours_layerwise_v1, baseline_v1)
V1 = "_v1"
#: a system's name ending in this (before any ``_v1``) runs its connector with every hook timed
#: (``hook_cost.py``: what the hooks cost the engine's thread per step, into the connector trace)
HOOKS = "_hooks"
BASE_SYSTEMS = ("recompute", "baseline", "null", "native", "lmcache", "lmcache_timed", "dynamo", *OURS)
HOOKED = tuple(n + HOOKS for n in ("null", "lmcache", *OURS))
SYSTEMS = (*BASE_SYSTEMS, *HOOKED, *(n + V1 for n in (*BASE_SYSTEMS, *HOOKED)))


def base_system(name):
    """The system ``name`` runs (``lmcache_v1`` -> ``lmcache``, ``ours_hooks_v1`` -> ``ours``)."""
    name = name[:-len(V1)] if name.endswith(V1) else name
    return name[:-len(HOOKS)] if name.endswith(HOOKS) else name


def system_kwargs(name, g2_gb, pass_index=0):
    """Engine kwargs and env for one system, in pass ``pass_index``."""
    v1 = name.endswith(V1)
    env = {"VLLM_USE_V2_MODEL_RUNNER": "0"} if v1 else {}
    kw = {"async_scheduling": False} if v1 else {}
    full, name = name, base_system(name)
    if name == "recompute":
        kw["enable_prefix_caching"] = False
    elif name == "baseline":
        pass
    elif name == "native":
        kw["kv_transfer_config"] = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                                    "kv_connector_extra_config": {"cpu_bytes_to_use": int(g2_gb * (1 << 30)),
                                                                  "num_cpu_blocks": None}}
        kw["_native_size"] = g2_gb
    elif name in ("lmcache", "lmcache_timed"):
        # lmcache_timed: the same connector, its hooks timed into the connector trace (peer_timing.py)
        kw["kv_transfer_config"] = {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"} \
            if name == "lmcache" else {"kv_connector": "TimedLMCacheConnectorV1", "kv_role": "kv_both",
                                       "kv_connector_module_path": "benchmarks.peer_timing"}
        env.update(LMCACHE_LOCAL_CPU="True", LMCACHE_MAX_LOCAL_CPU_SIZE=str(g2_gb), LMCACHE_CHUNK_SIZE="256",
                   LMCACHE_USE_EXPERIMENTAL="True")
    elif name == "null":
        # a connector that does nothing (null_connector.py): vLLM's own cost of running one
        kw["kv_transfer_config"] = {"kv_connector": "NullConnector", "kv_role": "kv_both",
                                    "kv_connector_module_path": "benchmarks.null_connector"}
    elif name == "dynamo":
        kw["kv_transfer_config"] = {"kv_connector": "DynamoConnector", "kv_role": "kv_both",
                                    "kv_connector_module_path": "kvbm.vllm_integration.connector"}
        env.update(DYN_KVBM_CPU_CACHE_GB=str(g2_gb), DYN_KVBM_METRICS="false")
    elif name in OURS:
        # ours: the connector's defaults (load_mode auto: async under vLLM's V2 runner or async
        # scheduling); the others: the same with the settings of OURS[name]
        kw["kv_transfer_config"] = json.loads(os.environ["OURS_KTC"])
        if full != "ours":
            # its own key namespace: the same service, but none of the "ours" run's blocks
            kw["kv_transfer_config"].setdefault("kv_connector_extra_config", {}).update(OURS[name], namespace=full)
        if pass_index > 0:
            # the kvbm service outlives the passes: a namespace per pass, so that every pass starts
            # without the blocks of the one before, like the peers' in-process caches
            extra = kw["kv_transfer_config"].setdefault("kv_connector_extra_config", {})
            extra["namespace"] = f"{extra.get('namespace') or full}_pass{pass_index}"
        env.update(DYN_KVBM_CPU_CACHE_GB=str(g2_gb))
        # KVBM_EAGER=1 starts kvbm's engines with eager module loading (gpu_layer_waits "eager"
        # puts the layer waits on the GPU only then; ours_layerwise_gpuwait does under lazy
        # loading too). NOTE: vLLM 0.26 then did not start within 300 s on the H200 (2026-11-26)
        if os.environ.get("KVBM_EAGER") == "1":
            env.update(CUDA_MODULE_LOADING="EAGER")
    else:
        raise SystemExit(f"unknown system {name}")
    if full.removesuffix(V1).endswith(HOOKS):  # the same connector, its hooks timed
        ktc = kw["kv_transfer_config"]
        ktc.update(kv_connector="Costed" + ktc["kv_connector"], kv_connector_module_path="benchmarks.hook_cost")
    return kw, env
