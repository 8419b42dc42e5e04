"""Build a tiny random Llama model directory that vLLM can load offline.

    python tests/vllm_support/make_tiny_model.py OUTDIR
    from make_tiny_model import build; build(outdir) -> Path

No hub access: a byte-level BPE tokenizer (vocab ~1024) is trained with
`tokenizers` on a fixed built-in corpus, wrapped in PreTrainedTokenizerFast
with a simple chat template, and a random LlamaForCausalLM (4 layers, hidden
256, 4 heads, 2 KV heads, head_dim 64, bf16) is saved with a fixed seed, so the
weights are deterministic. An existing complete build is reused (a stamp file
records the build parameters).

Needs torch, transformers and tokenizers (the vLLM venv has them).
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

VOCAB_SIZE = 1024
SEED = 1234
MODEL_CFG = dict(
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=4096,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    tie_word_embeddings=False,
)
STAMP_NAME = ".kvbm-tiny-model.json"
STAMP = {"version": 2, "vocab_size": VOCAB_SIZE, "seed": SEED, **MODEL_CFG}

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}</s>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>", "<|system|>", "<|user|>", "<|assistant|>"]


def _corpus() -> list[str]:
    """Deterministic text with enough variety for ~1024 BPE merges."""
    cons = "b c d f g h j k l m n p r s t v w z ch sh th st tr pl".split()
    vowels = "a e i o u ai ea ou".split()
    x = 12345

    def rnd() -> int:  # LCG: no dependence on `random`'s implementation
        nonlocal x
        x = (1103515245 * x + 12345) % (1 << 31)
        return x >> 8

    words = []
    for _ in range(3000):
        w = "".join(cons[rnd() % len(cons)] + vowels[rnd() % len(vowels)] for _ in range(1 + rnd() % 4))
        words.append(w)
    lines = []
    for _ in range(6000):
        sent = [words[rnd() % len(words)] for _ in range(4 + rnd() % 12)]
        num = str(rnd() % 100000)
        lines.append(" ".join(sent).capitalize() + f", {num}.")
    lines.append("".join(chr(c) for c in range(32, 127)))
    return lines


def _is_built(out: Path) -> bool:
    stamp = out / STAMP_NAME
    if not stamp.is_file():
        return False
    try:
        return json.loads(stamp.read_text()) == STAMP
    except ValueError:
        return False


def build(outdir: str | os.PathLike) -> Path:
    """Build the tiny model into `outdir` (idempotent). Returns the path."""
    out = Path(outdir).resolve()
    if _is_built(out):
        return out

    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".tmp-", dir=out.parent))

    # Tokenizer: byte-level BPE, deterministic given the fixed corpus.
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        model_max_length=MODEL_CFG["max_position_embeddings"],
    )
    hf_tok.chat_template = CHAT_TEMPLATE
    hf_tok.save_pretrained(tmp)
    vocab = len(hf_tok)  # == VOCAB_SIZE in practice

    cfg = LlamaConfig(
        vocab_size=vocab,
        bos_token_id=hf_tok.bos_token_id,
        eos_token_id=hf_tok.eos_token_id,
        pad_token_id=hf_tok.pad_token_id,
        dtype="bfloat16",
        **MODEL_CFG,
    )
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(cfg)
    # Larger init than the default 0.02 so the random model's greedy outputs
    # depend visibly on the context (KV corruption changes the output).
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.08)
    model = model.to(torch.bfloat16)
    model.config.dtype = torch.bfloat16
    model.save_pretrained(tmp, safe_serialization=True)
    if model.generation_config is not None:
        model.generation_config.save_pretrained(tmp)
    (tmp / STAMP_NAME).write_text(json.dumps(STAMP))
    os.chmod(tmp, 0o755)

    if out.exists():
        import shutil

        shutil.rmtree(out)
    os.replace(tmp, out)
    return out


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(f"usage: {argv[0]} OUTDIR", file=sys.stderr)
        return 2
    print(build(argv[1]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
