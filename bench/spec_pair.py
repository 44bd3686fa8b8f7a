"""Train a target and a draft model on agent-like text, so speculative decoding can be measured.

    python bench/spec_pair.py [--out spec-pair] [--target-steps 600] [--draft-steps 600]
    kvtier bench engine --preset spec-pair/target --speculative '{"method": "draft_model", "model": "spec-pair/draft", "num_speculative_tokens": 4}' --batch 1

The presets have random weights: their output copies nothing and no smaller model predicts
it, so a draft model cannot speed them up. This trains, on a CPU in minutes, a pair that
can: a target of kimi-tiny's shape (4 layers, MLA + MoE, 4.5 M parameters) and a draft a
fifth of its cost (2 dense layers, 128 wide), both on the same documents
(kvtier/bench/spec_text.py: an agent's tool calls and free prose, half each), with one
byte-level BPE tokenizer of 512 ids trained on them. Each lands as a checkpoint folder the
engine loads (config.json, model.safetensors, tokenizer.json).

Training runs in transformers' DeepseekV3ForCausalLM, the engine's correctness oracle
(tests/test_engine_model.py), which reads and writes the same hub names; the script checks
at the end that the engine's logits match transformers' for the trained weights.

Needs `pip install -e ".[test]"` (transformers, tokenizers, safetensors). Progress is shown;
The defaults took 44 minutes on this 2-core VM with two other jobs running (the target's 600
steps are most of it); a target step took 1.0 s in a probe with less beside it.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

from kvtier.bench.spec_text import KINDS, document
from kvtier.engine.config import ModelConfig, preset
from kvtier.engine.weights import random_weights, save_checkpoint
from kvtier.progress import progress

VOCAB = 512
BOS, EOS = "<bos>", "<eos>"
SEQ = 512                     # tokens per training row
BATCH = 8                     # rows per step


def target_config() -> ModelConfig:
    return preset("kimi-tiny").replace(bos_token_id=0, eos_token_id=1)


def draft_config() -> ModelConfig:
    """Two dense layers 128 wide: 1.07 ms a decoded token here, the target 5.25 (batch 1)."""
    return preset("kimi-tiny").replace(
        bos_token_id=0, eos_token_id=1, num_hidden_layers=2, first_k_dense_replace=2, hidden_size=128,
        intermediate_size=384, num_attention_heads=2, q_lora_rank=96, kv_lora_rank=64,
        qk_nope_head_dim=32, qk_rope_head_dim=32, v_head_dim=32)


def train_tokenizer(docs: list[str]):
    """A byte-level BPE of VOCAB ids (BOS = 0, EOS = 1), so every byte sequence encodes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=[BOS, EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(docs, trainer)
    return tok


def token_rows(tok, first_seed: int, rows: int) -> torch.Tensor:
    """[rows, SEQ] token ids: documents (alternating kinds) as BOS doc EOS, packed end to end."""
    stream: list[int] = []
    seed = first_seed
    while len(stream) < rows * SEQ:
        batch = [document(KINDS[s % 2], s) for s in range(seed, seed + 256)]
        seed += 256
        for enc in tok.encode_batch(batch, add_special_tokens=False):
            stream += [0, *enc.ids, 1]
    return torch.tensor(stream[:rows * SEQ]).view(rows, SEQ)


def hub_state(hf_state: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """transformers' parameters under the hub's names: its fused experts split back into one
    gate/up/down per expert (gate_up_proj[j] is [gate; up], as tests/test_engine_model.py checks)."""
    out: dict[str, torch.Tensor] = {}
    inter = config.moe_intermediate_size
    for name, t in hf_state.items():
        t = t.detach().float().contiguous()
        if name.endswith("mlp.experts.gate_up_proj"):
            p = name[:-len("gate_up_proj")]
            for j in range(t.shape[0]):
                out[f"{p}{j}.gate_proj.weight"] = t[j, :inter].clone()
                out[f"{p}{j}.up_proj.weight"] = t[j, inter:].clone()
        elif name.endswith("mlp.experts.down_proj"):
            p = name[:-len("down_proj")]
            for j in range(t.shape[0]):
                out[f"{p}{j}.down_proj.weight"] = t[j].clone()
        else:
            out[name] = t
    return out


def train(name: str, config: ModelConfig, out: Path, data: torch.Tensor, steps: int, lr: float, seed: int) -> None:
    """Train one model from small random weights and save it (with the tokenizer) to out."""
    import transformers
    torch.manual_seed(seed)
    save_checkpoint(out, config, random_weights(config, seed=seed, std=0.02))
    hf = transformers.DeepseekV3ForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="sdpa")
    hf.train()
    opt = torch.optim.AdamW(hf.parameters(), lr=lr, weight_decay=0.01, betas=(0.9, 0.95))
    warm = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warm) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps))))
    loss_avg = None
    with progress(f"training the {name}", steps) as bar:
        for step in range(steps):
            x = data[torch.randint(0, data.shape[0], (BATCH,))]
            loss = hf(x, labels=x).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(hf.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            sched.step()
            loss_avg = loss.item() if loss_avg is None else 0.95 * loss_avg + 0.05 * loss.item()
            bar.describe(f"training the {name}: loss {loss_avg:.3f}")
            bar.advance()
            if not sys.stderr.isatty() and (step + 1) % 100 == 0:      # progress in a log, too
                print(f"{name}: step {step + 1} of {steps}, loss {loss_avg:.3f}", flush=True)
    hf.eval()
    save_checkpoint(out, config, hub_state(hf.state_dict(), config))
    check_engine_matches(out, hf, data[0, :64].tolist())
    print(f"{name}: {steps} steps, final loss {loss_avg:.3f} ({loss_avg / math.log(2):.2f} bits per token) -> {out}")


def check_engine_matches(path: Path, hf, tokens: list[int], n: int = 24) -> None:
    """The engine loads what was saved and decodes transformers' greedy tokens (ties aside)."""
    from kvtier.engine import LLM, SamplingParams
    ref = list(tokens)
    with torch.no_grad():
        for _ in range(n):
            ref.append(int(hf(torch.tensor([ref])).logits[0, -1].argmax()))
    with LLM(str(path)) as llm:
        ours = llm.generate([tokens], SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))[0].token_ids
    same = sum(a == b for a, b in zip(ours, ref[len(tokens):]))
    print(f"{path}: the engine's greedy tokens equal transformers' at {same} of {n} positions")
    if same < n // 2:
        raise SystemExit(f"kvtier: error: the engine decodes {path} differently from transformers")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("spec-pair"), help="folder for target/ and draft/")
    p.add_argument("--target-steps", type=int, default=600)
    p.add_argument("--draft-steps", type=int, default=600)
    p.add_argument("--threads", type=int, default=2, help="torch threads for training")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    tok = train_tokenizer([document(KINDS[s % 2], s) for s in range(4000)])
    rows = max(args.target_steps, args.draft_steps) * BATCH // 4 + 64      # each row seen ~4 times
    data = token_rows(tok, first_seed=100_000, rows=rows)
    print(f"tokenizer: {tok.get_vocab_size()} ids; data: {data.numel():,} tokens")
    for name, config, steps, lr in (("target", target_config(), args.target_steps, 2e-3),
                                    ("draft", draft_config(), args.draft_steps, 3e-3)):
        out = args.out / name
        train(name, config, out, data, steps, lr, args.seed)
        tok.save(str(out / "tokenizer.json"))
        (out / "tokenizer_config.json").write_text(json.dumps({"bos_token": BOS, "eos_token": EOS}) + "\n")
    print(f"done in {time.perf_counter() - t0:.0f} s: {args.out}/target and {args.out}/draft")
    return 0


if __name__ == "__main__":
    sys.exit(main())
