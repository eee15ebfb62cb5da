"""The "ledger" task: a synthetic reasoning task whose solutions need facts produced far back.

Prompt (inside the chat template)::

    table:  n_1 v_1 f f f f   n_2 v_2 f f f f  ...  n_T v_T f f f f      (T facts "name has value")
    <|sep|>
    list:   q_1 q_2 ... q_{T+K}        (every table name and every variable x00..x{K-1}, shuffled)

Solution (what the model writes), one step per question of the list, then one step per variable::

    main phase, question q a table name:  q q v(q)   (c00 q v(q)) (c01 q v(q)) ... (c{S/3-1} q v(q))
    main phase, question q a variable:    q q u      (c00 q u) ...          with u = s(previous step's value)
    final phase, for x00, x01, ..., x{K-1}:  x x val(x) (c00 x val(x)) ...
    <|eos|>

``s`` is the successor on the 64 value tokens (v63 -> v00). The S "scratch" tokens restate the step's fact
behind a counter c00, c01, ...: local, predictable busy-work that no later step needs (the fact's first
statement serves). The counter makes the end of a step visible from the tokens themselves, and every step
ends with ``q v`` — a repeated or arithmetic filler would turn the step boundary into a counting problem,
which a 2-layer model does not learn. Every solution token is predictable from its context (dense
supervision):

* the question of a step is the token after the previous step's question in the list (an induction look-up
  whose distance grows over the trace);
* a table value is a content-addressed look-up into the prompt table (distance spread over the whole trace);
* a variable's value is *produced inside the solution*: it is defined at a random point of the main phase
  and looked up again in the final phase, so keeping the prompt alone cannot answer it;
* everything else (restated name, scratch, variable order, end of text) is local.

The answer is the final phase: the values of x00..x{K-1}. It is wrong if any table look-up before a
variable's definition went wrong (the variable's value chains from it) or if a definition was evicted.

Length: ``3 + T*(2+F) + 1 + (T+K) + 3`` prompt tokens (with the chat template) and ``(T+2K)*(3+S) + 1``
solution tokens; the default (T=48, K=16, F=0, S=12) gives a 167-token prompt and a 1,201-token solution;
``scratch`` scales it (S=96 gives 7,921 solution tokens).
"""

from __future__ import annotations

import dataclasses
import random

NUM_NAMES = 64
NUM_VALUES = 64
NUM_VARS = 32
NUM_FILLERS = 8
NUM_COUNTERS = 100  # scratch tokens c00, c01, ... (so a step's end is visible from the token itself)

SPECIALS = ["<|pad|>", "<|bos|>", "<|eos|>", "<|im_start|>", "<|im_end|>", "user", "assistant", "<|sep|>"]
FILLERS = [f"f{i}" for i in range(NUM_FILLERS)]
NAMES = [f"n{i:02d}" for i in range(NUM_NAMES)]
VALUES = [f"v{i:02d}" for i in range(NUM_VALUES)]
VARS = [f"x{i:02d}" for i in range(NUM_VARS)]
COUNTERS = [f"c{i:02d}" for i in range(NUM_COUNTERS)]
VOCAB = SPECIALS + FILLERS + NAMES + VALUES + VARS + COUNTERS
TOKEN_ID = {t: i for i, t in enumerate(VOCAB)}

PAD, BOS, EOS, IM_START, IM_END, USER, ASSISTANT, SEP = range(8)
FILLER0 = len(SPECIALS)
NAME0 = FILLER0 + NUM_FILLERS
VALUE0 = NAME0 + NUM_NAMES
VAR0 = VALUE0 + NUM_VALUES
COUNTER0 = VAR0 + NUM_VARS


def succ(value_id: int) -> int:
    """Successor of a value token id (v63 -> v00)."""
    return VALUE0 + (value_id - VALUE0 + 1) % NUM_VALUES


@dataclasses.dataclass(frozen=True)
class LedgerSpec:
    """Size of a ledger problem. ``scratch`` is the knob that scales the solution length."""

    facts: int = 48  # T: table entries in the prompt
    variables: int = 16  # K: variables defined in the solution and read back in the final phase
    filler: int = 0  # F: filler tokens after each table entry (never needed; the teacher is trained at 0)
    scratch: int = 12  # S: busy-work tokens after each step's value (never needed), a multiple of 3

    def __post_init__(self):
        if not 1 <= self.facts <= NUM_NAMES:
            raise ValueError(f"ledger facts must be in 1..{NUM_NAMES}, got {self.facts}")
        if not 0 <= self.variables <= NUM_VARS:
            raise ValueError(f"ledger variables must be in 0..{NUM_VARS}, got {self.variables}")
        if self.filler < 0 or self.scratch < 0 or self.scratch % 3 or self.scratch // 3 > NUM_COUNTERS:
            raise ValueError(f"ledger filler must be >= 0 and scratch a multiple of 3 up to {3 * NUM_COUNTERS}, "
                             f"got {self.filler}, {self.scratch}")

    @property
    def step_len(self) -> int:
        return 3 + self.scratch

    @property
    def solution_len(self) -> int:
        return (self.facts + 2 * self.variables) * self.step_len + 1


@dataclasses.dataclass
class LedgerProblem:
    prompt_ids: list[int]  # the whole prompt including the chat template, ends with "assistant"
    solution_ids: list[int]  # the worked solution, ends with <|eos|>
    answer: str  # "x00=v12 x01=v40 ..."
    lookups: list[tuple[int, int]]  # (position of use, position of the needed fact), absolute positions
    value_positions: list[int]  # absolute positions of looked-up values (table and variable look-ups)


def user_content_ids(facts: list[tuple[int, int]], fillers: list[list[int]], questions: list[int]) -> list[int]:
    ids: list[int] = []
    for (n, v), f in zip(facts, fillers):
        ids += [n, v] + f
    return ids + [SEP] + questions


def make_problem(spec: LedgerSpec, rng: random.Random) -> LedgerProblem:
    names = [NAME0 + i for i in rng.sample(range(NUM_NAMES), spec.facts)]
    values = [VALUE0 + rng.randrange(NUM_VALUES) for _ in names]
    fillers = [[FILLER0 + rng.randrange(NUM_FILLERS) for _ in range(spec.filler)] for _ in names]
    variables = [VAR0 + i for i in range(spec.variables)]
    questions = names[:] + variables
    rng.shuffle(questions)
    if questions[0] >= VAR0:  # the first step must be a table look-up (a variable chains from the step before)
        j = next(i for i, q in enumerate(questions) if q < VAR0)
        questions[0], questions[j] = questions[j], questions[0]

    content = user_content_ids(list(zip(names, values)), fillers, questions)
    prompt = [BOS, IM_START, USER] + content + [IM_END, IM_START, ASSISTANT]
    pos_of_fact = {}  # token -> absolute position of its value (latest definition)
    p = 3
    for n, v in zip(names, values):
        pos_of_fact[n] = (p + 1, v)
        p += 2 + spec.filler
    list_start = p + 1

    sol: list[int] = []
    lookups: list[tuple[int, int]] = []
    value_positions: list[int] = []
    base = len(prompt)

    def emit_step(q: int, val: int, fact_pos: int | None, q_src: int | None):
        start = base + len(sol)
        if q_src is not None:
            lookups.append((start, q_src))
        sol.extend([q, q, val])
        if fact_pos is not None:
            lookups.append((start + 2, fact_pos))
            value_positions.append(start + 2)
        for k in range(spec.scratch // 3):  # scratch: (counter, subject, value) triples (busy-work)
            sol.extend([COUNTER0 + k, q, val])

    for i, q in enumerate(questions):
        if q >= VAR0:
            u = succ(sol[-1])  # every step ends with its value: a value produced inside the solution
            emit_step(q, u, None, list_start + i)
            pos_of_fact[q] = (base + len(sol) - spec.step_len + 2, u)
        else:
            fpos, v = pos_of_fact[q]
            emit_step(q, v, fpos, list_start + i)
    answer = []
    for x in variables:
        fpos, u = pos_of_fact[x]
        emit_step(x, u, fpos, None)
        answer.append(f"{VOCAB[x]}={VOCAB[u]}")
    sol.append(EOS)
    return LedgerProblem(prompt, sol, " ".join(answer), lookups, value_positions)


def extract_answer(solution_ids: list[int], spec: LedgerSpec) -> str | None:
    """The final-phase answer written by a model, or None when the solution is malformed."""
    start = (spec.facts + spec.variables) * spec.step_len
    out = []
    for k in range(spec.variables):
        s = start + k * spec.step_len
        if s + 2 >= len(solution_ids):
            return None
        x, x2, val = solution_ids[s : s + 3]
        if x != VAR0 + k or x2 != x or not VALUE0 <= val < VALUE0 + NUM_VALUES:
            return None
        out.append(f"{VOCAB[x]}={VOCAB[val]}")
    return " ".join(out)


def check(solution_ids: list[int], answer: str, spec: LedgerSpec) -> bool:
    """The task's checker: the final phase must state every variable's value correctly."""
    return extract_answer(solution_ids, spec) == answer


def prompt_text(problem: LedgerProblem) -> str:
    """The user message (no chat template) as text, e.g. for a prompt dataset."""
    content = problem.prompt_ids[3:-3]
    return " ".join(VOCAB[i] for i in content)


def lookup_distance_shares(problems: list[LedgerProblem], thresholds=(256, 512, 1024)) -> dict[str, float]:
    d = [use - src for p in problems for use, src in p.lookups]
    return {f">{t}": sum(x > t for x in d) / len(d) for t in thresholds} | {"count": len(d), "max": max(d)}
