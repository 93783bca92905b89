"""RULER's synthetic task families, built offline at a context length counted in the scored model's tokens.

Task definitions follow RULER (Hsieh et al. 2024, arXiv 2404.06654; NVIDIA/RULER ``scripts/data/synthetic``) and
lm-evaluation-harness's ``ruler`` tasks; only the haystack text is local (:mod:`hybridlm.eval.ruler.haystack`):

* ``niah_*`` (needle in a haystack): needles "One of the special magic numbers for <key> is: <value>." hidden
  at random depths of a haystack; the model is asked for the value(s) of the queried key(s). Keys are two words of
  the haystack's word pool joined by a hyphen (RULER: adjective-noun), or UUIDs; values 7-digit numbers or UUIDs.
  ``single_1``: one needle in a repeated filler sentence; ``single_2`` / ``single_3``: one needle in the essay
  haystack, a number / a UUID; ``multikey_1``: 4 needles of different keys in the essay, one asked for;
  ``multikey_2`` / ``multikey_3``: the haystack is made of distractor needles of other keys (number / UUID
  values and, for ``_3``, UUID keys); ``multivalue``: 4 values for one key, all asked for; ``multiquery``: 4 keys
  asked for at once. Needle depths are drawn from 40 evenly spaced depths, 0 to 100 % of the haystack.
* ``vt`` (variable tracking): a chain ``VAR A = 12345``, ``VAR B = VAR A``, ... of 4 hops hidden in repeated filler;
  every variable holding the value is asked for; one worked example of the same task comes first.
* ``cwe`` (common words extraction): a numbered list of haystack words in which 10 words repeat more often than the
  others (below 4,096 tokens 6 times against once, else 30 against 3); the 10 are asked for, after a worked
  example of the task.
* ``fwe`` (frequent words extraction): coded 6-letter words drawn with Zipf frequencies (alpha 2, ``length // 50``
  words, the most frequent one replaced by the noise word ``...``); the 3 most frequent coded words are asked for.

Each item's prompt (chat template, when the tokenizer has one and ``chat`` is on, and the answer prefix after it)
plus the task's generation budget fits the length: the haystack is the largest that does (binary search on
haystack units: sentences, filler sentences, distractor needles, words). Every item is drawn from its own
``random.Random("seed/task/length/index")``, so a set of items is the same on every run and machine.
"""
from __future__ import annotations

import random
import string
import uuid
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Sequence, Tuple

import scipy.special

from hybridlm.config.errors import ConfigError
from hybridlm.eval.ruler.haystack import Haystack

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NEEDLE = "One of the special magic {types} for {key} is: {value}."
DEPTHS = [round(100 * i / 39) for i in range(40)]  # percent of the haystack
VT_HOPS, VT_CHAINS = 4, 1
CWE_COMMON = 10
FWE_TOP, FWE_ALPHA, FWE_WORD_LETTERS = 3, 2.0, 6
MAX_UNITS = 1 << 22


@dataclass(frozen=True)
class TaskSpec:
    name: str
    family: str             # niah, vt, cwe, fwe
    tokens_to_generate: int  # RULER's generation budget for the family
    haystack: str = ""       # niah: essay, repeat or needle
    key_kind: str = "words"  # niah: words or uuids
    value_kind: str = "numbers"  # niah: numbers or uuids
    keys: int = 1            # niah: needles of different keys
    values: int = 1          # niah: values per key
    queries: int = 1         # niah: keys asked for


def _niah(name, haystack, key_kind="words", value_kind="numbers", keys=1, values=1, queries=1) -> TaskSpec:
    return TaskSpec(name, "niah", 128, haystack, key_kind, value_kind, max(keys, queries), values, queries)


TASKS: Dict[str, TaskSpec] = {t.name: t for t in (
    _niah("niah_single_1", "repeat"),
    _niah("niah_single_2", "essay"),
    _niah("niah_single_3", "essay", value_kind="uuids"),
    _niah("niah_multikey_1", "essay", keys=4),
    _niah("niah_multikey_2", "needle"),
    _niah("niah_multikey_3", "needle", key_kind="uuids", value_kind="uuids"),
    _niah("niah_multivalue", "essay", values=4),
    _niah("niah_multiquery", "essay", queries=4),
    TaskSpec("vt", "vt", 30),
    TaskSpec("cwe", "cwe", 120),
    TaskSpec("fwe", "fwe", 50),
)}
TASK_GROUPS = {"all": list(TASKS), "niah": [n for n in TASKS if n.startswith("niah")]}


@dataclass
class RulerItem:
    task: str
    length: int              # the context length asked for (prompt tokens + generation budget <= length)
    index: int
    prompt: str              # the model's whole input: template, task text and answer prefix
    input_ids: List[int]
    answers: List[str]       # every one must appear in the output (RULER's string_match_all)
    tokens_to_generate: int
    units: int               # haystack units used (sentences, filler sentences, distractor needles or words)
    needles: List[str] = field(default_factory=list)  # niah: the planted needle sentences

    @property
    def tokens(self) -> int:
        return len(self.input_ids)


def resolve_tasks(specs: Sequence[str], where: str = "--tasks") -> List[str]:
    """Task names from names and groups (``all``, ``niah``), comma- or space-separated, in order, once each."""
    names: List[str] = []
    for spec in specs:
        for part in (p for p in spec.split(",") if p):
            found = TASK_GROUPS.get(part, [part] if part in TASKS else None)
            if found is None:
                raise ConfigError(f"{where}: unknown task {part!r} (tasks: {', '.join(TASKS)}; groups: "
                                  f"{', '.join(TASK_GROUPS)})")
            names += [n for n in found if n not in names]
    if not names:
        raise ConfigError(f"{where}: name at least one task")
    return names


# ------------------------------------------------------------------------------------------- drawing
def _number(rng: random.Random) -> str:
    return str(rng.randint(1_000_000, 9_999_999))


def _uuid(rng: random.Random) -> str:
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


def _key(rng: random.Random, words: Sequence[str]) -> str:
    return f"{rng.choice(words)}-{rng.choice(words)}"


def _distinct(rng: random.Random, make: Callable[[random.Random], str], n: int, taken: set) -> List[str]:
    out: List[str] = []
    while len(out) < n:
        v = make(rng)
        if v not in taken:
            taken.add(v)
            out.append(v)
    return out


def _join_keys(keys: Sequence[str]) -> str:
    return keys[0] if len(keys) == 1 else ", ".join(keys[:-1]) + ", and " + keys[-1]


# ------------------------------------------------------------------------------------------- drafts
# A draft is (task text, answer prefix, answers, needles) for a haystack of n units, drawn from a fresh
# random.Random(item seed): the same n always gives the same item, and a larger n only adds haystack.
Draft = Tuple[str, str, List[str], List[str]]


def draft_niah(spec: TaskSpec, hay: Haystack, rng: random.Random, n: int) -> Draft:
    make_key = _uuid if spec.key_kind == "uuids" else (lambda r: _key(r, hay.words))
    make_value = _uuid if spec.value_kind == "uuids" else _number
    start = rng.randrange(len(hay.sentences))
    taken: set = set()
    keys = _distinct(rng, make_key, spec.keys, taken)
    values = [_distinct(rng, make_value, spec.values, taken) for _ in keys]
    types = spec.value_kind
    needles = [NEEDLE.format(types=types, key=k, value=v) for k, vs in zip(keys, values) for v in vs]
    rng.shuffle(needles)
    asked = rng.sample(range(len(keys)), spec.queries)
    if spec.haystack == "essay":
        sents = [hay.sentences[(start + i) % len(hay.sentences)] for i in range(n)]
        # a drawn number that the text happens to hold would be found twice: such haystacks move on a sentence
        while any(v in s for s in sents for vs in values for v in vs):
            start += 1
            sents = [hay.sentences[(start + i) % len(hay.sentences)] for i in range(n)]
        cuts = sorted(int(n * d / 100) for d in rng.sample(DEPTHS, len(needles)))
        parts, last = [], 0
        for cut, needle in zip(cuts, needles):
            parts += sents[last:cut] + [needle]
            last = cut
        context = " ".join(parts + sents[last:])
    else:
        if spec.haystack == "repeat":
            units = [FILLER] * n
        else:  # distractor needles of other keys
            units = [NEEDLE.format(types=types, key=k, value=v) for k, v in
                     zip(_distinct(rng, make_key, n, taken), _distinct(rng, make_value, n, taken))]
        for pos, needle in sorted(zip(rng.sample(range(n), len(needles)), needles), reverse=True):
            units.insert(pos, needle)
        context = "\n".join(units)
    query_keys = [keys[i] for i in asked]
    answers = [v for i in asked for v in values[i]]
    query = _join_keys(query_keys)
    if len(answers) == 1:
        one = types[:-1]
        text = (f"A special magic {one} is hidden within the following text. Memorize it: you will be asked about "
                f"the {one} afterwards.\n{context}\nWhat is the special magic {one} for {query} mentioned in the "
                f"provided text?")
        prefix = f"The special magic {one} for {query} mentioned in the provided text is"
    else:
        text = (f"Some special magic {types} are hidden within the following text. Memorize them: you will be asked "
                f"about the {types} afterwards.\n{context}\nWhat are all the special magic {types} for {query} "
                f"mentioned in the provided text?")
        prefix = f"The special magic {types} for {query} mentioned in the provided text are"
    return text, prefix, answers, needles


def _vt_text(rng: random.Random, n: int, taken: set) -> Tuple[str, str, List[str]]:
    names = _distinct(rng, lambda r: "".join(r.choices(string.ascii_uppercase, k=5)), VT_HOPS + 1, taken)
    value = str(rng.randint(10000, 99999))
    chain = [f"VAR {names[0]} = {value}"] + [f"VAR {names[j + 1]} = VAR {names[j]}" for j in range(VT_HOPS)]
    units = [FILLER] * n
    for j, pos in enumerate(sorted(rng.sample(range(n), len(chain)))):
        units.insert(pos + j, chain[j])
    context = "\n".join(units)
    text = (f"Memorize and track the chain of variable assignments hidden in the following text.\n\n{context}\n"
            f"Question: Find all variables that are assigned the value {value} in the text above.")
    prefix = (f"Answer: According to the chain of variable assignments in the text above, {len(names)} variables "
              f"are assigned the value {value}, they are:")
    return text, prefix, names


def draft_vt(spec: TaskSpec, hay: Haystack, rng: random.Random, n: int) -> Draft:
    taken: set = set()
    example, example_prefix, example_names = _vt_text(rng, 8, taken)  # RULER's worked example: a short one
    text, prefix, names = _vt_text(rng, n, taken)
    return f"{example}\n{example_prefix} {' '.join(example_names)}\n\n{text}", prefix, names, []


def _numbered(words: Sequence[str]) -> str:
    return " ".join(f"{i + 1}. {w}" for i, w in enumerate(words))


def _cwe_text(rng: random.Random, words: List[str], common: int, rare: int) -> Tuple[str, List[str]]:
    top = words[:CWE_COMMON]
    listed = top * common + words[CWE_COMMON:] * rare
    rng.shuffle(listed)
    text = (f"Below is a numbered list of words. Some of them appear more often than others. Memorize the ones "
            f"that appear most often.\n{_numbered(listed)}\nQuestion: What are the {CWE_COMMON} most common words "
            f"in the above list?")
    return text, top


def draft_cwe(spec: TaskSpec, hay: Haystack, rng: random.Random, n: int, length: int) -> Draft:
    (ex_words, ex_common, ex_rare), (common, rare) = (((20, 3, 1), (6, 1)) if length < 4096
                                                      else ((40, 10, 3), (30, 3)))
    if ex_words + n > len(hay.words):
        raise ConfigError(f"--haystack {hay.source!r}: {len(hay.words)} distinct words, cwe at {length} tokens needs "
                          f"more; use a larger text")
    drawn = rng.sample(hay.words, len(hay.words))[:ex_words + n]  # a whole shuffle: a larger n only adds words
    example, example_top = _cwe_text(rng, drawn[:ex_words], ex_common, ex_rare)
    text, top = _cwe_text(rng, drawn[ex_words:], common, rare)
    prefix = f"Answer: The top {CWE_COMMON} words that appear most often in the list are:"
    return f"{example}\n{prefix} {_numbered(example_top)}\n\n{text}", prefix, top, []


def fwe_counts(n: int, vocab: int) -> List[int]:
    """Occurrences of each of ``vocab`` coded words among ``n`` Zipf-distributed words (rank k: n k^-alpha / zeta)."""
    zeta = float(scipy.special.zeta(FWE_ALPHA))
    return [int(n * k ** -FWE_ALPHA / zeta) for k in range(1, vocab + 1)]


def draft_fwe(spec: TaskSpec, hay: Haystack, rng: random.Random, n: int, length: int) -> Draft:
    vocab = _distinct(rng, lambda r: "".join(r.choices(string.ascii_lowercase, k=FWE_WORD_LETTERS)),
                      max(length // 50, FWE_TOP + 2), set())
    vocab[0] = "..."  # the most frequent word is noise
    counts = fwe_counts(n, len(vocab))
    words = [w for w, c in zip(vocab, counts) for _ in range(c)]
    rng.shuffle(words)
    text = (f"Read the following coded text and track the frequency of each coded word. Find the three most "
            f"frequently appearing coded words. {' '.join(words)}\nQuestion: Do not provide any explanation. Please "
            f"ignore the dots '....'. What are the three most frequently appearing words in the above coded text?")
    prefix = "Answer: According to the coded text above, the three most frequently appearing words are:"
    return text, prefix, vocab[1:1 + FWE_TOP], []


def fwe_min_words(vocab: int) -> int:
    """The fewest words for which the top three coded words are each strictly more frequent than the next."""
    n = 16
    while True:
        c = fwe_counts(n, vocab)
        if c[1] > c[2] > c[3] > max(c[4:] + [0]) and c[3] > 0:
            return n
        n += 16


MIN_UNITS = {"niah": 1, "vt": VT_HOPS + 1, "cwe": CWE_COMMON + 1}


# ------------------------------------------------------------------------------------------ fitting
class PromptRenderer:
    """Task text + answer prefix -> (prompt, ids) with the model's tokenizer: inside its chat template when
    ``chat`` (the answer prefix opens the assistant turn), else the plain text, a space and the answer prefix."""

    def __init__(self, tokenizer, chat: bool):
        self.tokenizer, self.chat = tokenizer, chat
        tokenizer.model_max_length = 1 << 40  # whole prompts are tokenized to be measured: no length warning

    def __call__(self, text: str, prefix: str) -> Tuple[str, List[int]]:
        if self.chat:
            prompt = self.tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                        add_generation_prompt=True) + prefix
            return prompt, self.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        prompt = f"{text} {prefix}"
        return prompt, self.tokenizer(prompt)["input_ids"]


def _draft_fn(spec: TaskSpec, hay: Haystack, length: int) -> Callable[[random.Random, int], Draft]:
    if spec.family == "niah":
        return lambda rng, n: draft_niah(spec, hay, rng, n)
    if spec.family == "vt":
        return lambda rng, n: draft_vt(spec, hay, rng, n)
    if spec.family == "cwe":
        return lambda rng, n: draft_cwe(spec, hay, rng, n, length)
    return lambda rng, n: draft_fwe(spec, hay, rng, n, length)


def build_item(task: str, length: int, index: int, hay: Haystack, render: PromptRenderer, seed: int) -> RulerItem:
    """Item ``index`` of ``task`` at ``length`` tokens: the largest haystack whose prompt plus the generation budget
    fits ``length`` (ConfigError when even the smallest does not)."""
    spec = TASKS[task]
    draft = _draft_fn(spec, hay, length)
    item_seed = f"{seed}/{task}/{length}/{index}"
    budget = length - spec.tokens_to_generate
    cache: Dict[int, Tuple[Draft, str, List[int]]] = {}

    def attempt(n: int):
        if n not in cache:
            d = draft(random.Random(item_seed), n)
            cache[n] = (d, *render(d[0], d[1]))
        return cache[n]

    def fits(n: int) -> bool:
        return len(attempt(n)[2]) <= budget

    lo = MIN_UNITS.get(spec.family, 0) or fwe_min_words(max(length // 50, FWE_TOP + 2))
    if not fits(lo):
        raise ConfigError(f"--lengths: {length} tokens is too short for {task} (its smallest prompt takes "
                          f"{len(attempt(lo)[2])} tokens and it generates up to {spec.tokens_to_generate})")
    hi = lo * 2
    while fits(hi):  # lengths grow with n: double until too long, then bisect
        lo, hi = hi, hi * 2
        if hi > MAX_UNITS:
            raise ConfigError(f"--lengths: {length} tokens needs more than {MAX_UNITS} haystack units for {task}")
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    (text, prefix, answers, needles), prompt, ids = attempt(lo)
    return RulerItem(task, length, index, prompt, ids, answers, spec.tokens_to_generate, lo, needles)


def build_items(tasks: Sequence[str], lengths: Sequence[int], items: int, hay: Haystack, render: PromptRenderer,
                seed: int) -> List[RulerItem]:
    return [build_item(t, L, i, hay, render, seed) for t in tasks for L in lengths for i in range(items)]
