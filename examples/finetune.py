"""Single-GPU fine-tune of a causal LM with OffloadAdamW: a plain PyTorch loop.

The model's parameters and gradients stay on the accelerator in bf16; the float32 master weights
and both Adam moments (12 bytes per parameter) live in host memory, where OffloadAdamW updates them
and writes the rounded bf16 copy back into the model. Nothing else of a usual loop changes:
gradient clipping, a learning-rate schedule and checkpoint/resume work as with torch.optim.AdamW.

    python examples/finetune.py --model path/or/hub-id --steps 200 --out run1
    python examples/finetune.py --model path/or/hub-id --steps 400 --out run1 --resume

Without ``--model`` it builds a small random byte-level Llama, so the script runs anywhere (CPU
included) without downloads. The text is the Python standard library's sources
(:mod:`offload_adamw.demo.data`) unless ``--text FILE`` is given.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch
from tqdm.auto import tqdm

from offload_adamw import OffloadAdamW
from offload_adamw.demo.data import CorpusConfig, load_corpus


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="a transformers causal LM (hub id or local path); default: a small random byte Llama")
    p.add_argument("--text", type=Path, help="a UTF-8 text file to train on (default: the standard library's sources)")
    p.add_argument("--steps", type=int, default=100, help="total optimizer steps (a resumed run continues up to this)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16", help="model parameter dtype on the device")
    p.add_argument("--save-every", type=int, default=50, help="write a checkpoint every N steps (and at the end)")
    p.add_argument("--out", type=Path, default=Path("finetune-out"))
    p.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint.pt")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stop-at", type=int, help="save and stop at this step, as a preempted job would (to try --resume)")
    return p.parse_args(argv)


def build_model_and_tokens(args, device: torch.device, dtype: torch.dtype):
    """The model on ``device`` in ``dtype`` and the training text as a 1-D tensor of token ids."""
    if args.text is not None:
        text = args.text.read_text(encoding="utf-8", errors="replace")
    else:
        corpus = load_corpus(CorpusConfig(max_bytes=2_000_000, seed=args.seed))
        text = bytes(corpus.train.tolist()).decode("utf-8", errors="replace")
    if args.model:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.model)
        tokens = torch.tensor(tokenizer(text)["input_ids"], dtype=torch.long)
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype)
    else:
        from transformers import LlamaConfig, LlamaForCausalLM

        tokens = torch.tensor(list(text.encode("utf-8")), dtype=torch.long)
        torch.manual_seed(args.seed)
        model = LlamaForCausalLM(LlamaConfig(
            vocab_size=256, hidden_size=128, intermediate_size=344, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=max(256, args.seq_len),
        )).to(dtype)
    return model.to(device), tokens


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    model, tokens = build_model_and_tokens(args, device, dtype)
    model.train()

    # Exactly torch.optim.AdamW's arguments; the state goes to (pinned) host memory in float32.
    optimizer = OffloadAdamW(
        model.parameters(), lr=args.lr, weight_decay=args.weight_decay, betas=(0.9, 0.95),
    )

    def schedule(step: int) -> float:  # linear warmup, cosine decay to 10%
        if step < args.warmup:
            return (step + 1) / args.warmup
        progress = (step - args.warmup) / max(1, args.steps - args.warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    args.out.mkdir(parents=True, exist_ok=True)
    checkpoint = args.out / "checkpoint.pt"
    start = 0
    if args.resume:
        # The whole training state: model, optimizer (float32 masters and moments, step counts),
        # schedule, data position. Restoring all of it continues the same run bit for bit.
        saved = torch.load(checkpoint, map_location="cpu", weights_only=False)
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        scheduler.load_state_dict(saved["scheduler"])
        start = saved["step"]
        print(f"resumed from {checkpoint} at step {start}", file=sys.stderr)

    def save(step: int) -> None:
        tmp = checkpoint.with_suffix(".tmp")
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict(), "step": step}, tmp)
        tmp.replace(checkpoint)  # never leave a half-written checkpoint behind

    def batch(step: int):
        # The batch of a step depends only on (seed, step): a resumed run sees the same data.
        g = torch.Generator().manual_seed(args.seed * 1_000_003 + step)
        starts = torch.randint(0, tokens.numel() - args.seq_len - 1, (args.batch_size,), generator=g)
        x = torch.stack([tokens[s : s + args.seq_len] for s in starts.tolist()])
        return x.to(device)

    bar = tqdm(range(start, args.steps), initial=start, total=args.steps, desc="fine-tune", unit="step")
    for step in bar:
        input_ids = batch(step)
        loss = model(input_ids=input_ids, labels=input_ids).loss
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        bar.set_postfix(loss=f"{loss.item():.3f}", grad_norm=f"{float(grad_norm):.2f}")
        if (step + 1) % args.save_every == 0 or step + 1 in (args.steps, args.stop_at):
            save(step + 1)
        if step + 1 == args.stop_at:
            break
    bar.close()
    n = sum(p.numel() for p in model.parameters())
    print(f"{n / 1e6:.1f} M parameters; optimizer state in host memory: {optimizer.host_state_bytes() / 2**20:.1f} MiB "
          f"({optimizer.host_state_bytes() / n:.1f} B/parameter); checkpoint: {checkpoint}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
