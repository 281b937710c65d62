"""OffloadAdamW in the transformers Trainer: one argument, everything else unchanged.

    python examples/trainer.py --model path/or/hub-id --steps 200 --out run1
    python examples/trainer.py --model path/or/hub-id --steps 400 --out run1 --resume

``optimizer_cls_and_kwargs=(OffloadAdamW, kwargs)`` lets the Trainer build its usual parameter
groups (no weight decay on biases and norms) and learning-rate schedule; clipping
(``max_grad_norm``), checkpoints (``optimizer.pt`` holds the float32 masters and moments) and
``resume_from_checkpoint`` work as with ``optim="adamw_torch_fused"``, whose results OffloadAdamW
reproduces bit for bit on float32 models.

Without ``--model`` it builds a small random byte-level Llama and trains on the Python standard
library's sources, so the script runs anywhere without downloads.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from offload_adamw import OffloadAdamW
from offload_adamw.demo.data import CorpusConfig, load_corpus


class Windows(torch.utils.data.Dataset):
    """Consecutive token windows; the model shifts the labels itself."""

    def __init__(self, tokens: torch.Tensor, seq_len: int):
        self.tokens, self.seq_len = tokens, seq_len

    def __len__(self) -> int:
        return (self.tokens.numel() - 1) // self.seq_len

    def __getitem__(self, i):
        x = self.tokens[i * self.seq_len : (i + 1) * self.seq_len]
        return {"input_ids": x, "labels": x}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="a transformers causal LM (hub id or local path); default: a small random byte Llama")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--save-steps", type=int, default=50)
    p.add_argument("--out", type=Path, default=Path("trainer-out"))
    p.add_argument("--resume", action="store_true", help="continue from the last checkpoint in --out")
    return p.parse_args(argv)


def main(argv=None) -> int:
    from transformers import Trainer, TrainingArguments

    args = parse_args(argv)
    corpus = load_corpus(CorpusConfig(max_bytes=2_000_000))
    text = bytes(corpus.train.tolist()).decode("utf-8", errors="replace")
    dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    if args.model:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tokens = torch.tensor(AutoTokenizer.from_pretrained(args.model)(text)["input_ids"], dtype=torch.long)
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype)
    else:
        from transformers import LlamaConfig, LlamaForCausalLM

        tokens = torch.tensor(list(text.encode("utf-8")), dtype=torch.long)
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(
            vocab_size=256, hidden_size=128, intermediate_size=344, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=max(256, args.seq_len),
        )).to(dtype)

    training_args = TrainingArguments(
        output_dir=str(args.out), max_steps=args.steps, per_device_train_batch_size=args.batch_size,
        learning_rate=args.lr, weight_decay=0.01, warmup_steps=min(10, args.steps // 10), lr_scheduler_type="cosine",
        max_grad_norm=1.0, logging_steps=10, save_strategy="steps", save_steps=args.save_steps, report_to=[],
        use_cpu=not torch.cuda.is_available(), seed=0,
    )
    trainer = Trainer(
        model=model, args=training_args, train_dataset=Windows(tokens, args.seq_len),
        # The one line that changes: the Trainer builds groups and schedule, OffloadAdamW the update.
        optimizer_cls_and_kwargs=(OffloadAdamW, {"lr": args.lr, "betas": (0.9, 0.95), "eps": 1e-8}),
    )
    trainer.train(resume_from_checkpoint=True if args.resume else None)
    optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    n = sum(p.numel() for p in model.parameters())
    print(f"trained to step {trainer.state.global_step}; optimizer state in host memory: "
          f"{optimizer.host_state_bytes() / 2**20:.1f} MiB for {n / 1e6:.1f} M parameters; checkpoints in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
