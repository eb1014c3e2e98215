"""Train the tiny retrieval model shipped with evalkit (CPU, about 15 minutes on 2 cores).

    python -m evalkit.models.train_tiny --out evalkit/assets/kv_retrieval_tiny --stop-at-final-stage

Builds a word-level tokenizer over the synthetic task's vocabulary and a small Llama (GQA), trains it on random
prompts of the built-in task (loss on the answer and the end-of-sequence token only) and saves both with
``save_pretrained``, so ``AutoModelForCausalLM.from_pretrained(out)`` loads it.
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from tqdm import tqdm
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from evalkit.models import synthetic

MAX_PAIRS = 80  # training lists reach beyond the task's 40-72 entries


def build_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {token: index for index, token in enumerate(synthetic.vocabulary())}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", vocab["<s>"])])
    return PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<pad>",
        model_max_length=512, padding_side="left",
    )


def build_model(
    tokenizer, hidden_size: int = 128, layers: int = 2, head_dim: int = 64, rope_theta: float = 500000.0
) -> LlamaForCausalLM:
    # Wide heads (4 x 64 on a 128-wide residual) make the key-matching head easy to learn among ~100 distractors; a
    # Llama-3 RoPE base leaves many slowly rotating dimensions, so a key matches its earlier copy at any distance.
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=2 * hidden_size, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim, max_position_embeddings=512,
        rope_parameters={"rope_type": "default", "rope_theta": rope_theta},
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=True,
    )
    return LlamaForCausalLM(config)


def batch(
    tokenizer, rng: random.Random, size: int, min_pairs: int, max_pairs: int, queries: int = 1,
    vocab: tuple[int, int] = (synthetic.NUM_KEYS, synthetic.NUM_VALUES),
):
    """Left-padded prompts, each followed by ``queries`` question/answer rounds; labels on the answers only.

    Several questions per prompt give several answers to learn from per sequence; evaluation asks one. ``vocab``:
    how many keys and values the prompts draw from.
    """
    rows, answer_positions = [], []
    for _ in range(size):
        n_pairs = rng.randint(min_pairs, max_pairs)
        example = synthetic.make_example(rng, n_pairs, rng.random(), *vocab)
        pairs = example["context"].split()
        rounds = [(example["question"], example["answer"])]
        # Each key asked at most once: an asked key's value would otherwise also sit, in another order, in an
        # earlier question round, and "find the earlier copy, say the token before it" would become ambiguous.
        others = [i for i in range(n_pairs) if i != example["needle_index"]]
        for needle in rng.sample(others, min(queries - 1, len(others))):
            rounds.append((f"? {pairs[3 * needle + 2]}", f"{pairs[3 * needle + 1]} {pairs[3 * needle]}"))
        ids = tokenizer(example["context"])["input_ids"]
        positions = []
        for question, answer in rounds:
            ids += tokenizer(question, add_special_tokens=False)["input_ids"]
            answer_ids = tokenizer(answer, add_special_tokens=False)["input_ids"]
            positions += range(len(ids), len(ids) + len(answer_ids))
            ids += answer_ids
        ids.append(tokenizer.eos_token_id)
        positions.append(len(ids) - 1)
        rows.append(ids)
        answer_positions.append(positions)
    width = max(len(r) for r in rows)
    input_ids = torch.full((size, width), tokenizer.pad_token_id)
    mask = torch.zeros(size, width, dtype=torch.long)
    labels = torch.full((size, width), -100)
    for i, (ids, positions) in enumerate(zip(rows, answer_positions)):
        offset = width - len(ids)
        input_ids[i, offset:] = torch.tensor(ids)
        mask[i, offset:] = 1
        for position in positions:
            labels[i, offset + position] = input_ids[i, offset + position]
    return input_ids, mask, labels


@torch.no_grad()
def accuracy(model, tokenizer, rng, n=256, min_pairs=40, max_pairs=72, vocab=(synthetic.NUM_KEYS, synthetic.NUM_VALUES)):
    """Share of prompts whose two answer tokens are both predicted (teacher forcing, full attention)."""
    model.eval()
    input_ids, mask, labels = batch(tokenizer, rng, n, min_pairs, max_pairs, vocab=vocab)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=input_ids, attention_mask=mask, position_ids=positions).logits
    model.train()
    # The sequence ends "? k v u </s>": logits at -4 and -3 predict the two value tokens.
    return (logits[:, -4:-2].argmax(-1) == input_ids[:, -3:-1]).all(dim=1).float().mean().item()


def save(model, tokenizer, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=20000, help="at most this many steps")
    parser.add_argument("--batch-size", type=int, default=96)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--seed", type=int, default=3)
    parser.add_argument("--target", type=float, default=0.995, help="stop early once held-out accuracy reaches it")
    parser.add_argument("--hidden-size", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--stop-at-final-stage", action="store_true",
                        help="stop (and save) as soon as the curriculum reaches the task's full size: the shipped model")
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--rope-theta", type=float, default=500000.0)
    parser.add_argument("--queries", type=int, default=16, help="question rounds per training prompt")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    tokenizer = build_tokenizer()
    model = build_model(tokenizer, args.hidden_size, args.layers, args.head_dim, args.rope_theta)
    model.config._attn_implementation = "sdpa"
    train(model, tokenizer, args, random.Random(args.seed))
    model.eval()
    save(model, tokenizer, args.out)
    print(f"saved to {args.out}; final held-out accuracy {accuracy(model, tokenizer, random.Random(99)):.3f}")


def train(model, tokenizer, args: argparse.Namespace, rng: random.Random) -> None:
    """Train ``model`` on the curriculum until held-out accuracy reaches ``args.target`` (or ``args.steps`` run out),
    saving a checkpoint at each mastered stage."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 100))
    model.train()
    start = time.time()
    progress = tqdm(range(args.steps), desc="train", mininterval=10)
    # Curriculum over list length and vocabulary: the lookup circuit forms within a few hundred steps on 4 pairs
    # over 16 keys/values (and barely at all on the full vocabulary); each mastered stage doubles the vocabulary
    # and lengthens the lists until they are those of the task.
    max_pairs, vocab = 4, (16, 16)
    for step in progress:
        input_ids, mask, labels = batch(tokenizer, rng, args.batch_size, 2, max_pairs, queries=args.queries, vocab=vocab)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        loss = model(input_ids=input_ids, attention_mask=mask, position_ids=positions, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        if step % 100 == 99:
            acc = accuracy(model, tokenizer, random.Random(10_000 + step), 64, max_pairs // 2, max_pairs, vocab)
            progress.set_postfix(loss=f"{loss.item():.3f}", max_pairs=max_pairs, vocab=vocab[0], acc=f"{acc:.2f}")
            final = max_pairs >= MAX_PAIRS and vocab == (synthetic.NUM_KEYS, synthetic.NUM_VALUES)
            if acc > 0.9 and not final:
                max_pairs = min(MAX_PAIRS, max(max_pairs + 8, max_pairs * 3 // 2))
                vocab = (min(synthetic.NUM_KEYS, vocab[0] * 2), min(synthetic.NUM_VALUES, vocab[1] * 2))
                max_pairs = min(max_pairs, vocab[0])
                save(model, tokenizer, args.out)  # a checkpoint per mastered stage: nothing lost if stopped
                tqdm.write(f"step {step + 1}: accuracy {acc:.2f}; now up to {max_pairs} pairs over {vocab[0]} keys")
                if args.stop_at_final_stage and max_pairs >= MAX_PAIRS and vocab == (synthetic.NUM_KEYS, synthetic.NUM_VALUES):
                    break
            elif acc >= args.target and final:
                held_out = accuracy(model, tokenizer, random.Random(20_000 + step))
                tqdm.write(f"step {step + 1}: held-out accuracy {held_out:.3f} ({time.time() - start:.0f}s)")
                if held_out >= args.target:
                    break


if __name__ == "__main__":
    main()
