"""What tensor parallelism sends between sockets in one decode step, and how long that takes on a ring of them.

Each pass of the model over T tokens (the model's layers, or one multi-token-prediction block per draft) needs:
  * the embedding, split by vocabulary over the sockets: one all-reduce of T x hidden activations;
  * every layer: an all-reduce of T x hidden after attention and another after the MLP (the sockets' partial sums of
    the output projections). A mixture-of-experts layer splits each expert over the sockets, as the weights are placed
    here, so its shared and routed experts sum into that one all-reduce; expert parallelism (all-to-all) is not modelled;
  * attention split by token (``kv_sharding: sequence``): every head's query all-gathered to every socket, and the
    partial outputs with their softmax max and sum reduce-scattered back to their heads' sockets;
  * the sampling that ends it, from logits split by vocabulary: an all-reduce of each token's best score and index
    (8 bytes), which is also the step's synchronisation.
On a ring of tp sockets an all-reduce of S bytes sends 2(tp-1)/tp S over each socket's link in 2(tp-1) hops, an
all-gather or a reduce-scatter half of that: time = bytes / ``link_bandwidth`` + hops x ``link_latency``. None of it
overlaps the step's memory reads. One socket (tp = 1) sends nothing.
"""

from __future__ import annotations

from .geometry import dtype_bytes

SAMPLED_TOKEN_BYTES = 8  # a score and a token index


def ring_seconds(payload: float, tp: int, hardware, phases: int = 2) -> float:
    """A collective over a ring of ``tp`` sockets on ``payload`` bytes: ``phases`` 2, an all-reduce; 1, an all-gather
    or a reduce-scatter."""
    if tp == 1:
        return 0.0
    return phases * ((tp - 1) / tp * payload / hardware.link_bandwidth + (tp - 1) * hardware.link_latency)


def pass_seconds(deployment, layers: int, tokens: int) -> float:
    """One pass over ``layers`` layers for ``tokens`` tokens: the collectives listed in this module's docstring."""
    d, model = deployment, deployment.model
    element = dtype_bytes(d.activation_dtype)
    all_reduce = ring_seconds(tokens * model.hidden_size * element, d.tp, d.hardware)
    seconds = (2 * layers + 1) * all_reduce + ring_seconds(tokens * SAMPLED_TOKEN_BYTES, d.tp, d.hardware)
    if d.kv_sharding == "sequence":
        query, output = model.split_attention_values()
        seconds += layers * sum(ring_seconds(tokens * n * element, d.tp, d.hardware, phases=1) for n in (query, output))
    return seconds


def step_seconds(deployment) -> float:
    """The communication of one decode step: the model on ``1 + mtp_tokens`` tokens per sequence, then the MTP block
    once per draft on the batch."""
    d = deployment
    if d.tp == 1:
        return 0.0
    return pass_seconds(d, d.model.layers, d.batch * (1 + d.mtp_tokens)) + \
        d.mtp_tokens * pass_seconds(d, d.model.mtp_layers, d.batch)
