"""kvpress 0.5.5's ``CAMPress`` beside evalkit's ``cam``: the same random GQA Llama, prompt and decode tokens through
kvpress' press around the model's forward and evalkit's ``CompressionSession``; after the last step, do they hold
the same positions per layer and KV head, with the same keys and the same merged values?

    python benchmarks/parity_cam.py [--venv .kvpress-venv]

The model (4 layers, 8 query and 2 KV heads of 32, fp32, seeded) is parity_model.py's, saved once and loaded by both
sides, kvpress 0.5.5 in its own environment (made on demand as in bench_vs_kvpress.py; where it cannot be made, one
line and exit 0). Both rank by KNorm (kvpress ``CAMPress(KnormPress())``, evalkit ``cam`` with its default scorer,
``capacity = target_size + compression_interval``) and are fed the same tokens: a prompt within ``target_size``
(kvpress' press alone compresses nothing at prefill; evalkit keeps such a prompt whole), then ``STEPS`` tokens one at
a time at their positions, all of them distinct (in layer 0 a repeated token's key has the same norm at every
position: a tie the last bit would break). One case compresses every ``interval`` steps from the first; in the other
the cache is still within its target when ``interval`` steps have passed, and kvpress' step counter runs on until it
exceeds it.

The draws: kvpress draws its merge mask with ``torch.bernoulli`` from torch's global generator; its worker hands that
call the generator evalkit's ``cam`` seeds for the same layer and step (``merge_generator``: from ``SEED``, the layer
and the step's position), so that both sides draw alike. kvpress' kept slots are read at each compression as the rows
of the keys its pruned cache holds (gathered, equal bit for bit), its positions tracked from them. The table prints,
per case, the heads (over all layers) whose held positions agree, the positions that differ, the largest absolute
difference of keys and of values over the agreeing heads, the draws that merged on each side, and on how many steps
the two sides' next greedy tokens agree.
"""

from __future__ import annotations

from parity_model import agreement, load_saved, model_options, save_model
from parity_runner import Parity, Side, kvpress_environment, run_parity

STEPS, SEED = 100, 0
# case: (kvpress' target_size, compression_interval, merge_budget, prompt tokens)
CASES = {
    "every interval": (192, 24, 32, 192),
    "counter past the interval": (256, 32, 8, 200),
}


def merge_generator(layer: int, position: int):
    """evalkit's ``evalkit.compression.methods.cam.merge_generator`` at ``SEED`` (kvpress' environment does not
    import evalkit)."""
    import torch

    return torch.Generator().manual_seed((position + 1_000_003 * (layer + 1_000_003 * SEED)) % 2 ** 32)


def sequence(length: int):
    """The prompt ``[1, length]`` and the ``STEPS`` tokens fed after it, all distinct."""
    import torch

    ids = 3 + torch.randperm(997, generator=torch.Generator().manual_seed(1))[: length + STEPS]
    return ids[None, :length], ids[length:].tolist()


def heads_of(positions, valid, values, keys=None) -> list[dict]:
    """Per KV head, its held positions (``positions`` ``[H, S]`` where ``valid``) in text order with their values
    (``[1, H, S, D]``) and, where given, keys."""
    out = []
    for head in range(values.shape[1]):
        slots = valid[head].nonzero().flatten()
        slots = slots[positions[head, slots].argsort()]
        out.append({"kept": positions[head, slots].tolist(), "values": values[0, head, slots].tolist()})
        if keys is not None:
            out[-1]["keys"] = keys[0, head, slots].tolist()
    return out


def counting_bernoulli(state: dict, give_generator: bool):
    """``torch.bernoulli`` counting the draws that merged into ``state["merged"]``; for kvpress, drawing from the
    generator of ``state``'s layer and position."""
    import torch

    draw = torch.bernoulli

    def bernoulli(p, *args, **kwargs):
        if give_generator:
            drawn = draw(p.float().cpu(), generator=merge_generator(state["layer"], state["position"])).to(p)
        else:
            drawn = draw(p, *args, **kwargs)
        state["merged"] += int(drawn.sum())
        return drawn

    torch.bernoulli = bernoulli


def track_positions(press, positions: dict, state: dict) -> None:
    """``press.compress`` made to follow the prompt positions each layer holds (``positions``, by layer: kvpress
    keeps none), from the rows of the keys each compression keeps; ``state["layer"]`` says the layer compressing."""
    original = press.compress

    def compress(module, hidden_states, keys, values, attentions, kwargs):
        state["layer"] = module.layer_idx
        kept_keys, kept_values = original(module, hidden_states, keys, values, attentions, kwargs)
        rows = (kept_keys[0, 0][:, None, :] == keys[0, 0][None, :, :]).all(dim=-1).float().argmax(dim=-1)
        positions[module.layer_idx] = positions[module.layer_idx][rows]
        return kept_keys, kept_values

    press.compress = compress


def replay(model, press, prompt, tokens: list, positions: dict, state: dict, after_prefill=None):
    """``prompt`` then ``tokens`` fed one at a time at their positions under ``press``: the cache and the greedy
    token before each step; every layer's ``positions`` grows by the step's (``after_prefill()`` runs between)."""
    import torch
    from transformers import DynamicCache

    length, cache, greedy = prompt.shape[1], DynamicCache(), []
    with torch.no_grad(), press(model):
        logits = model(input_ids=prompt, past_key_values=cache, use_cache=True).logits[:, -1]
        if after_prefill is not None:
            after_prefill()
        for step, token in enumerate(tokens):
            greedy.append(int(logits.argmax()))
            state["position"] = length + step
            for index in positions:
                positions[index] = torch.cat([positions[index], torch.tensor([length + step])])
            logits = model(input_ids=torch.tensor([[token]]), past_key_values=cache, use_cache=True,
                           position_ids=torch.tensor([[length + step]])).logits[:, -1]
    return cache, greedy


def run_kvpress(model) -> dict:
    import kvpress
    import torch

    out, state = {}, {"merged": 0}
    counting_bernoulli(state, give_generator=True)
    for case, (target, interval, budget, length) in CASES.items():
        prompt, tokens = sequence(length)
        press = kvpress.CAMPress(kvpress.KnormPress(), compression_interval=interval, target_size=target,
                                 merge_budget=budget)
        positions = {index: torch.arange(length) for index in range(model.config.num_hidden_layers)}
        state["merged"] = 0
        track_positions(press, positions, state)
        cache, greedy = replay(model, press, prompt, tokens, positions, state)
        heads = [heads_of(positions[i].expand(layer.keys.shape[1], -1), torch.ones(layer.keys.shape[1:3], dtype=bool),
                          layer.values, layer.keys) for i, layer in enumerate(cache.layers)]
        out[case] = {"heads": heads, "tokens": greedy, "merged": state["merged"]}
    return out


def cam_replay(model, prompt, tokens: list, target: int, interval: int, budget: int):
    """evalkit's ``cam`` (``capacity = target + interval``, seeded ``SEED``) fed ``prompt`` then ``tokens`` one at a
    time: its session and the greedy token before each step."""
    import torch

    import evalkit.compression as ec

    session = ec.CompressionSession(model, ec.CaM.from_config(target + interval, interval=interval,
                                                              merge_budget=budget, seed=SEED))
    logits, greedy = session.prefill(prompt), []
    for token in tokens:
        greedy.append(int(logits.argmax()))
        logits = session.step(torch.tensor([[token]]))[:, -1]
    return session, greedy


def run_evalkit(model) -> dict:
    out, state = {}, {"merged": 0}
    counting_bernoulli(state, give_generator=False)
    for case, (target, interval, budget, length) in CASES.items():
        prompt, tokens = sequence(length)
        state["merged"] = 0
        session, greedy = cam_replay(model, prompt, tokens, target, interval, budget)
        heads = [heads_of(layer.heads.positions[0], layer.heads.valid[0], layer.values, layer.keys)
                 for layer in session.cache.layers]
        out[case] = {"heads": heads, "tokens": greedy, "merged": state["merged"]}
    return out


def largest_difference(pairs: list, name: str) -> float:
    return max((abs(x - y) for a, b in pairs for ra, rb in zip(a[name], b[name]) for x, y in zip(ra, rb)),
               default=float("nan"))


def without_grad(side):
    """A side ``side(model)`` as a worker runs it, gradients off: on the model :func:`save_model` wrote."""

    def compute(args) -> dict:
        import torch

        torch.set_grad_enabled(False)
        return side(load_saved(args.model)[0])

    return compute


SIDES = {"kvpress": Side(without_grad(run_kvpress), reference=True), "evalkit": Side(without_grad(run_evalkit))}


def compare(parity: Parity, args) -> None:
    save_model(parity.folder, 8)  # the prompt is this script's own
    theirs_all, ours_all = parity.both("--model", str(parity.folder))
    print(f"{'case':<26} heads agreeing  positions differing  max |dkeys|  max |dvalues|  merged (kvpress, evalkit)  "
          "next tokens agreeing")
    for case, theirs in theirs_all.items():
        ours = ours_all[case]
        same, heads, differ = agreement([[h["kept"] for h in layer] for layer in theirs["heads"]],
                                        [[h["kept"] for h in layer] for layer in ours["heads"]])
        pairs = [(a, b) for la, lb in zip(theirs["heads"], ours["heads"]) for a, b in zip(la, lb) if a["kept"] == b["kept"]]
        agree = sum(a == b for a, b in zip(theirs["tokens"], ours["tokens"]))
        print(f"{case:<26} {same}/{heads:<13} {differ:<20} {largest_difference(pairs, 'keys'):>11.2e}  "
              f"{largest_difference(pairs, 'values'):>12.2e}  {theirs['merged']:>7}, {ours['merged']:<17} "
              f"{agree}/{STEPS}")


if __name__ == "__main__":
    run_parity(__file__, __doc__, SIDES, compare, options=model_options, environment=kvpress_environment)
