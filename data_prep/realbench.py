"""Prompts of the real-model benchmark (``make realbench``): templated multi-step math word problems with a checkable
answer, and open-ended long-form writing prompts, in two splits that are disjoint by construction.

Each split draws from its own pools (people's names, items, writing subjects and settings are split in two by a
seeded shuffle before any prompt is made), so no held-out prompt shares a name, an item or a subject with a
training prompt; the numbers come from a generator seeded per split. The file lists the training rows first and
the held-out rows after them, then a second block of training rows (``--more``): the recipe reads its
``traces.num_prompts`` training rows in file order, skipping the held-out block, and ``eval.num_problems`` held-out
rows. The shipped file holds 384 held-out rows (the recipe evaluates on the first 48; ``--set eval.num_problems=192``
separates methods whose 48-trace intervals touch); a generator seeded per block makes every row independent of how
many follow, so a larger split keeps the earlier rows and their cached references, and the held-out rows keep their
places whatever the number of training rows.

The second training block draws from the training side of every pool plus pools of its own (``MORE_*``: more
subjects, topics, names and items, never in a held-out row), so that a scorer can be trained on many more traces
(``traces.num_prompts`` up to 264 + ``--more``) without a single held-out name or topic.

    python -m data_prep.realbench --out data_prep/prompts/realbench.jsonl   # the shipped file (deterministic)
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

NAMES = ["Anna", "Ben", "Carla", "David", "Elena", "Farid", "Grace", "Hugo", "Ines", "Jonas", "Keiko", "Liam", "Maya",
         "Nikolai", "Olivia", "Pedro", "Quinn", "Rosa", "Samir", "Tara", "Umar", "Vera", "Wen", "Xavier", "Yara",
         "Zoltan", "Amara", "Bruno", "Chloe", "Dmitri", "Esme", "Felix", "Gita", "Hassan", "Isla", "Jamal", "Kira",
         "Lucas", "Mina", "Noah"]
ITEMS = ["apples", "marbles", "stickers", "books", "pencils", "coins", "stamps", "cookies", "seashells", "buttons",
         "candles", "tickets", "cards", "beads", "plants", "bottles", "bricks", "eggs", "postcards", "ribbons", "shells",
         "toy cars", "notebooks", "oranges"]
SUBJECTS = ["a lighthouse keeper who finds a message in a bottle", "a robot learning to bake bread",
            "two rival chess players stranded on an island", "a city where it never stops raining",
            "a girl who can talk to birds", "an old clockmaker and his last clock", "a train that never arrives",
            "a village that forgets one word every day", "a detective who is afraid of the dark",
            "a family running a small bakery in winter", "an astronaut alone on the Moon", "a dragon who collects books",
            "a musician who loses her hearing", "a boy who builds a boat from scrap", "a library that opens at midnight",
            "a farmer and a stubborn goat", "a map that changes every night", "a king who wants to be a gardener",
            "a storm that lasts a hundred days", "a painter who paints the future", "a mountain rescue team",
            "a ghost who is shy", "a spy who cannot keep secrets", "a school for young inventors",
            "a ship's cat on a long voyage", "a town built on the back of a turtle", "twins separated at birth",
            "a baker who bakes for a queen", "a forest where the trees move", "a lost dog finding its way home",
            "a scientist who shrinks herself", "a teacher in a mountain village", "a pirate who hates the sea",
            "a market that sells memories", "a knight afraid of horses", "a city under a glass dome"]
ESSAYS = ["life in a big city compared with life in a small village", "how a car engine works, part by part",
          "how to grow vegetables at home, season by season", "the history of writing, from clay tablets to computers",
          "how bridges are designed and built", "how the human heart works", "how to plan a long journey on foot",
          "how bread is made, from the field to the table", "how weather forecasts are made",
          "how a small shop can become a large company", "how volcanoes form and erupt", "how to learn a new language",
          "the life cycle of stars", "how rivers shape the land", "how to train for a marathon",
          "how electricity reaches a home", "the history of sailing ships", "how bees live and make honey",
          "how a newspaper is produced", "how to build a wooden chair", "how the immune system fights illness",
          "how cities handle their water", "the invention of printing and its effects", "how chess players think"]
FORMS = [("Write a very long, detailed story in {n} chapters about {s}. Give every chapter a title and several "
          "paragraphs, and describe the places, the people and what happens step by step."),
         ("Write a long diary about {s}, one entry per day for {n} days, each entry with several paragraphs."),
         ("Write a long series of {n} letters exchanged between two characters in a story about {s}. Each letter "
          "should be several paragraphs long."),
         ("Write a long, detailed report in {n} sections on {e}. Explain each section in depth with examples, then "
          "summarise what you explained."),
         ("Write a long lecture for beginners about {e}, in {n} parts. Explain every part slowly, with examples and "
          "questions for the listeners.")]

# training-only pools of the second training block (none of these strings is in a pool above)
MORE_NAMES = ["Aiko", "Bjorn", "Celia", "Dario", "Emeka", "Freya", "Goran", "Hana", "Ivo", "Jada", "Kofi", "Lena",
              "Milo", "Nadia", "Oren", "Priya", "Rafael", "Sana", "Tomas", "Ulla"]
MORE_ITEMS = ["crayons", "walnuts", "balloons", "magnets", "spoons", "lemons", "tiles", "feathers", "pebbles", "socks",
              "chestnuts", "keys"]
MORE_SUBJECTS = ["a lighthouse on a frozen lake", "a tailor who sews maps into coats", "a circus that lost its tent",
                 "an inventor who builds a talking kettle", "a postman delivering letters to the past",
                 "a gardener who grows glass flowers", "a choir of street musicians", "a beekeeper and a bear",
                 "a radio station at the end of the world", "a chef who cannot taste", "a bridge that sings at night",
                 "a cartographer lost in her own map", "a fisherman who catches a star", "a hotel for retired robots",
                 "a desert caravan and a broken compass", "a museum guard who talks to statues",
                 "a violin maker's apprentice", "a tower of books in a flood", "an island that drifts every winter",
                 "a carpenter building a house for owls"]
MORE_ESSAYS = ["how a sailing boat is steered against the wind", "how glass is made", "how coffee is grown and roasted",
               "how a library is organised", "how a bicycle works, part by part", "how to keep chickens",
               "how tides are caused by the Moon", "how paper money is printed and protected",
               "how a lighthouse guides ships", "how clocks keep time", "how to cook for a large family",
               "how earthquakes are measured", "how a football club is run", "how wool becomes a sweater",
               "how satellites stay in orbit", "how to build a small garden pond"]


def _split(pool: list, rng: random.Random) -> tuple[list, list]:
    p = list(pool)
    rng.shuffle(p)
    h = len(p) // 2
    return p[:h], p[h:]


def math_problem(rng: random.Random, names: list[str], items: list[str]) -> tuple[str, str]:
    """A four-step word problem (buy, give away, share equally with a remainder) and its answer."""
    a, b, c, d = rng.randint(20, 90), rng.randint(3, 9), rng.randint(4, 12), rng.randint(5, 30)
    k = rng.randint(3, 8)
    name, friend, item = rng.choice(names), rng.choice(names), rng.choice(items)
    while friend == name:
        friend = rng.choice(names)
    total = a + b * c - d
    each, left = divmod(total, k)
    text = (f"{name} has {a} {item}. {name} buys {b} packs with {c} {item} in each pack, then gives {d} {item} to "
            f"{friend}. After that, {name} shares the rest equally among {k} children and keeps what cannot be shared "
            f"equally. How many {item} does each child get, and how many does {name} keep? Solve the problem step by "
            "step, explain every step in detail, check your result in a second way, and put the final answer as "
            "'each, kept' within \\boxed{}.")
    return text, f"{each}, {left}"


def writing_prompt(rng: random.Random, subjects: list[str], essays: list[str]) -> str:
    form = rng.choice(FORMS)
    return form.format(n=rng.randint(5, 12), s=rng.choice(subjects), e=rng.choice(essays))


def make_prompts(n_train: int, n_heldout: int, seed: int = 0, more: int = 0) -> list[dict]:
    """``n_train`` training rows, ``n_heldout`` held-out rows, then ``more`` training rows, half math and half writing
    in each block, all distinct; the held-out rows share no name, item, subject or essay topic with any training row."""
    rng = random.Random(seed)
    pools = {k: _split(v, rng) for k, v in (("names", NAMES), ("items", ITEMS), ("subjects", SUBJECTS),
                                            ("essays", ESSAYS))}
    extra = {"names": MORE_NAMES, "items": MORE_ITEMS, "subjects": MORE_SUBJECTS, "essays": MORE_ESSAYS}
    pools = {k: (*v, v[0] + extra[k]) for k, v in pools.items()}  # side 2: the training side and its own pools
    rows, seen = [], set()
    for split, n, side in (("train", n_train, 0), ("heldout", n_heldout, 1), ("train", more, 2)):
        srng = random.Random(seed * 1_000_003 + side + 1)
        made = 0
        while made < n:
            if made % 2 == 0:
                text, answer, kind = *math_problem(srng, pools["names"][side], pools["items"][side]), "math"
            else:
                text, answer, kind = writing_prompt(srng, pools["subjects"][side], pools["essays"][side]), "", "writing"
            if text in seen:
                continue
            seen.add(text)
            rows.append({"prompt": text, "answer": answer, "kind": kind, "split": split})
            made += 1
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("data_prep/prompts/realbench.jsonl"))
    ap.add_argument("--train", type=int, default=264)
    ap.add_argument("--heldout", type=int, default=384)
    ap.add_argument("--more", type=int, default=1056, help="training rows after the held-out ones")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    rows = make_prompts(a.train, a.heldout, a.seed, a.more)
    a.out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"{len(rows)} prompts ({a.train} + {a.more} training, {a.heldout} held-out) -> {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
