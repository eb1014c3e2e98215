"""SCBench: evalkit's own offline generators for the four synthetic tasks (kv, prefix_suffix, vt, mf), which the
official repository does not ship. :func:`generate` makes rows in the hub's schema (scbench.py turns them into
docs); the same arguments give the same rows. Standard library only.
"""

from __future__ import annotations

import json
import random
import string

CHARS_PER_TOKEN = 4
GENERATOR_VERSION = "1"  # the generated data's identity: bump it when a generator's output changes
SYNTHETIC = ("kv", "prefix_suffix", "vt", "mf")


def generate(task: str, lengths=(1024,), n_sessions: int = 10, turns: int = 5, seed: int = 1234) -> list[dict]:
    """Rows in the hub's schema (plus ``length``, the requested context tokens at :data:`CHARS_PER_TOKEN` characters
    each): ``n_sessions`` per length, ``turns`` queries each, the same for the same arguments."""
    check(task, lengths, n_sessions, turns)
    return [row for index, length in enumerate(lengths)
            for row in sessions(task, length, n_sessions, turns, seed, first_id=index * int(n_sessions))]


def check(task: str, lengths, n_sessions: int, turns: int) -> None:
    """A ValueError (one line) where :func:`generate` cannot take these arguments."""
    if task not in BUILDERS:
        raise ValueError(f"no generator for scbench_{task}: only {', '.join(SYNTHETIC)}")
    if int(turns) < 1 or int(n_sessions) < 1:
        raise ValueError(f"task.dataset.turns and n_sessions must be at least 1, got {turns} and {n_sessions}")
    for length in lengths:
        if int(length) < 64:
            raise ValueError(f"task.dataset.lengths: {length} is too short (at least 64 tokens)")


def sessions(task: str, length: int, n_sessions: int, turns: int, seed: int, first_id: int = 0):
    """The rows of one length, made one at a time as they are read (the length's own random stream, so that the
    sessions of a length do not depend on those of another); ids from ``first_id``."""
    rng = random.Random(f"scbench-{task}-{seed}-{length}")
    for index in range(int(n_sessions)):
        context, multi_turns = BUILDERS[task](rng, int(length) * CHARS_PER_TOKEN, int(turns))
        yield {"id": first_id + index, "context": context, "multi_turns": multi_turns, "length": int(length)}


def _uuid(rng: random.Random) -> str:
    """``str(uuid.UUID(int=rng.getrandbits(128), version=4))``, formatted directly (the same text, faster)."""
    value = rng.getrandbits(128) & ~(0xC000 << 48) | 0x8000 << 48  # the variant (RFC 4122)
    text = f"{value & ~(0xF000 << 64) | 4 << 76:032x}"  # the version
    return f"{text[:8]}-{text[8:12]}-{text[12:16]}-{text[16:20]}-{text[20:]}"


def _kv_row(rng: random.Random, budget: int, turns: int):
    """InfiniteBench's kv_retrieval: a JSON object of random UUID pairs (``JSON data:\\n{...}``); each turn asks one
    key (``Key: "<uuid>"\\nThe value associated with the specified key is: ``), the answer its value."""
    count = max(turns, (budget - 13) // 80)  # '"<36>": "<36>", ' is 80 characters
    pairs = {_uuid(rng): _uuid(rng) for _ in range(count)}
    keys = list(pairs)
    asked = rng.sample(keys, turns)
    return "JSON data:\n" + json.dumps(pairs), [
        {"input": f'Key: "{key}"\nThe value associated with the specified key is: ', "answer": pairs[key]}
        for key in asked]


_ALPHANUMERIC = string.ascii_letters + string.digits
PREFIX_SUFFIX_QUESTION = ('Find the string in the list above that starts with "{prefix}" and ends with "{suffix}". '
                          "Answer with the string only.\nThe string is: ")


def _prefix_suffix_row(rng: random.Random, budget: int, turns: int):
    """The paper's Retr.Prefix-Suffix: a long list of random strings (one a line, 16 to 40 letters and digits); each
    turn asks for the one string that starts with a given 4-character prefix and ends with a given 4-character
    suffix. Each target has 4 decoys: 2 with its prefix and another suffix, 2 with its suffix and another prefix."""
    def word(size):
        return "".join(rng.choice(_ALPHANUMERIC) for _ in range(size))

    ends = set()
    while len(ends) < 4 * turns:
        ends.add(word(4))
    ends = sorted(ends)
    rng.shuffle(ends)
    lines, multi_turns = [], []
    for t in range(turns):
        prefix, suffix, other_prefix, other_suffix = ends[4 * t: 4 * t + 4]
        target = prefix + word(rng.randint(8, 32)) + suffix
        lines += [target, *(prefix + word(rng.randint(8, 32)) + other_suffix for _ in range(2)),
                  *(other_prefix + word(rng.randint(8, 32)) + suffix for _ in range(2))]
        multi_turns.append({"input": PREFIX_SUFFIX_QUESTION.format(prefix=prefix, suffix=suffix), "answer": target})
    asked = {(t["answer"][:4], t["answer"][-4:]) for t in multi_turns}
    size = sum(len(line) + 1 for line in lines)
    while size < budget:
        line = word(rng.randint(16, 40))
        if (line[:4], line[-4:]) in asked or line[:4] in ends or line[-4:] in ends:
            continue
        lines.append(line)
        size += len(line) + 1
    rng.shuffle(lines)
    return "\n".join(lines), multi_turns


VT_INSTRUCTION = "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"
VT_NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.\n"
VT_QUESTION = ("Question: Find all variables that are assigned the value {value} in the text above. Answer: According "
               "to the chain(s) of variable assignment in the text above, {count} variables are assgined the value "
               "{value}, they are: ")
VT_HOPS = 4


def _vt_row(rng: random.Random, budget: int, turns: int):
    """RULER's variable_tracking: chains ``VAR A = 12345``, ``VAR B = VAR A``, ... (4 hops, 5-letter names) at random
    places among repeated noise sentences; turn t asks for every variable holding chain t's value (RULER's question
    and answer prefix, its typo "assgined" kept), the answer the chain's names."""
    names = set()
    while len(names) < turns * (VT_HOPS + 1):
        names.add("".join(rng.choice(string.ascii_uppercase) for _ in range(5)))
    names = sorted(names)
    rng.shuffle(names)
    values = rng.sample(range(10000, 100000), turns)
    chains = []
    for t in range(turns):
        chain = names[t * (VT_HOPS + 1): (t + 1) * (VT_HOPS + 1)]
        chains.append([f"VAR {chain[0]} = {values[t]}"] + [f"VAR {chain[j + 1]} = VAR {chain[j]} "
                                                            for j in range(VT_HOPS)])
    statements = sum(len(s) + 1 for chain in chains for s in chain)
    sentences = [VT_NOISE] * max(VT_HOPS + 2, (budget - len(VT_INSTRUCTION) - statements) // (len(VT_NOISE) + 1))
    for chain in chains:
        positions = sorted(rng.sample(range(len(sentences)), len(chain)))
        for offset, (position, statement) in enumerate(zip(positions, chain)):
            sentences.insert(position + offset, statement)
    context = VT_INSTRUCTION + " ".join(sentences).replace(". \n", ".\n")
    return context, [{"input": VT_QUESTION.format(value=values[t], count=VT_HOPS + 1),
                      "answer": names[t * (VT_HOPS + 1): (t + 1) * (VT_HOPS + 1)]} for t in range(turns)]


MF_STATISTICS = {  # InfiniteBench math_find's questions ("The largest number of the list is: "), and more of its kind
    "largest number": lambda s: s[-1], "smallest number": lambda s: s[0], "median": lambda s: s[len(s) // 2],
    "second largest number": lambda s: s[-2], "second smallest number": lambda s: s[1],
    "third largest number": lambda s: s[-3], "third smallest number": lambda s: s[2],
}


def _mf_row(rng: random.Random, budget: int, turns: int):
    """The paper's Math.Find: a list of distinct non-negative integers (an odd count, so the median is one of
    them); each turn asks one statistic of it (``The <statistic> of the list is: ``), the answer an int."""
    count = max(7, budget // 6)
    for _ in range(2):  # numbers widen with the count: size the list by their printed width
        universe = max(10_000, 10 * count)
        count = max(7, budget // (len(str(universe - 1)) + 2))
    count -= 1 - count % 2
    numbers = rng.sample(range(max(10_000, 10 * count)), count)
    ordered = sorted(numbers)
    names = []
    while len(names) < turns:
        names += rng.sample(sorted(MF_STATISTICS), len(MF_STATISTICS))
    return numbers, [{"input": f"The {name} of the list is: ", "answer": MF_STATISTICS[name](ordered)}
                     for name in names[:turns]]


BUILDERS = {"kv": _kv_row, "prefix_suffix": _prefix_suffix_row, "vt": _vt_row, "mf": _mf_row}
