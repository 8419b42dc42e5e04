"""The workload of the vLLM peers harness (``vllm_peers.py``): the model's shape, the users'
prompts, the untimed prompts an engine runs first, and cold prompts that share nothing with them.
Pure and seeded: every system gets the same tokens."""
import json
import os
import random

QWEN3_4B = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 2560,
    "intermediate_size": 9728, "num_hidden_layers": 36, "num_attention_heads": 32,
    "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936, "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6, "rope_theta": 1000000, "hidden_act": "silu", "torch_dtype": "bfloat16",
    "tie_word_embeddings": True, "attention_bias": False, "bos_token_id": 151643, "eos_token_id": 151645,
}


def workload(users, rounds, sys_len, ctx_len, turn_len, seed=11):
    """``(round, user, prompt)`` in the order the sequential harness sends them: every user's
    prompt is a shared system part, its private context, and per round its history (the turns
    before, each followed by a 32-token reply) and a new turn."""
    rnd = random.Random(seed)
    tok = lambda n: [rnd.randrange(100, 150000) for _ in range(n)]
    system = tok(sys_len)
    hist = {u: system + tok(ctx_len) for u in range(users)}
    out = []
    for r in range(rounds):
        for u in range(users):
            hist[u] = hist[u] + tok(turn_len)
            out.append((r, u, list(hist[u])))
            hist[u] = hist[u] + tok(32)
    return out


def warmup_prompts(args):
    """The untimed prompts an engine runs first: a throwaway one (the kernels), and with
    --warmup-turn one user's two turns (the shapes of a warm turn: a short new part after a long prefix)."""
    out = [list(range(1000, 1600))]
    if args.warmup_turn:
        out += [prompt for _, _, prompt in workload(1, 2, args.sys_len, args.ctx_len, args.turn_len, seed=99991)]
    return out


def cold_prompts(n, seed=7):
    """Endless prompts of ``n`` tokens that share nothing with the workload's (--cold-before-warm, --strangers)."""
    rnd = random.Random(seed)
    while True:
        yield [rnd.randrange(150001, 151000)] + [rnd.randrange(100, 150000) for _ in range(n - 1)]


def write_model_config(model, tiny=False):
    """``model``/config.json: Qwen3-4B's shape (vLLM makes up the weights), or (``tiny``) a
    two-layer model for a smoke test on a CPU build."""
    os.makedirs(model, exist_ok=True)
    cfg = dict(QWEN3_4B)
    if tiny:
        cfg.update(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=64, vocab_size=152000)
    with open(os.path.join(model, "config.json"), "w") as f:
        json.dump(cfg, f)
