"""Write ``corpus.txt``, the small English corpus the examples train on.

The corpus is plain prose written for this project (no third-party text) plus a
long "keeper's log" generated from a fixed grammar with a seeded
``random.Random``, so the output is the same bytes on every run and every
platform. Run it from anywhere::

    python examples/data/make_corpus.py            # rewrites examples/data/corpus.txt
    python examples/data/make_corpus.py --check    # exit 1 when corpus.txt is stale

The file is committed, so the examples never need to run this script.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

CORPUS_PATH = Path(__file__).with_name("corpus.txt")
SEED = 1234
LOG_ENTRIES = 420

ESSAYS = [
    (
        "The Keeper of the North Light",
        """\
The lighthouse stood on a shelf of black rock at the end of a long spit of sand, and
the keeper who lived there kept a log of everything that happened, because nothing much
ever did. He wrote down the wind and the height of the tide, the ships that passed and
the birds that came to rest on the gallery rail. He wrote down the weather in the
morning and again at dusk, when he climbed the hundred and twelve steps to light the
lamp. In the winter he trimmed the wick four times a night. In the summer, when the
nights were short, he trimmed it twice and slept a little longer.

He had come to the light as a young man, with a trunk of books and a violin he could
not play. The books he read many times over, until he knew which pages were torn and
which had notes in the margin from the keeper before him. The violin he learned slowly,
in the long evenings, and by the tenth winter he could play three songs well enough
that the gulls stopped complaining. A supply boat came once a month when the sea
allowed it, and brought flour, oil, letters, and news that was always a month old.

The keeper did not mind the news being old. He said that most news improved with age,
like cheese, because by the time it reached him half of it had turned out not to be
true. What mattered to him was the lamp, the clockwork that turned the lens, and the
ships that depended on both. A light that goes dark for one hour can undo a hundred
years of faithful service, he wrote, and so he checked the clockwork every evening and
wound it every four hours through the night, even when the sea was calm and no ship
was in sight.
""",
    ),
    (
        "On Bread",
        """\
Bread asks for very little and gives back a great deal. Flour, water, salt and a
little yeast, and then time, which is the ingredient that cooks forget. The dough must
rest before it is shaped and rest again after, and a baker who hurries it will get a
loaf that is heavy in the middle and pale on the outside. There is no trick that
replaces patience. A warm kitchen helps, and a cold one slows everything down, but in
the end the dough decides when it is ready, and the baker's work is to notice.

To notice, you press the dough gently with a floured finger. If the dent springs back
at once, the dough needs more time. If it springs back slowly and leaves a small mark,
it is ready for the oven. If it does not spring back at all, it has waited too long,
and the loaf will spread and sag. Most of baking is learning to read small signs like
this one: the colour of the crust, the sound of the loaf when you knock on its base,
the smell that fills the house a few minutes before the bread is done.

Every baker keeps notes, whether on paper or in memory. How much water the new flour
took. How long the dough rose on a wet day in autumn. Which shelf of the oven burns the
bottom of the loaf. The notes are never finished, because the flour changes, the
weather changes, and the oven grows older every year. That is why bread is never
boring. It is the same four things every morning, and it is never quite the same loaf.
""",
    ),
    (
        "The River and the Mill",
        """\
Below the village the river ran fast over a bed of round grey stones, and there the
miller had built his wheel. The wheel turned the great stone that ground the corn, and
the corn came down from the farms on the hill in carts pulled by slow brown horses.
In a dry summer the river ran low and the wheel turned slowly, and the farmers waited
in a line along the lane, talking about rain. In a wet spring the river ran high and
brown, and the miller opened the sluice so that the water would not tear the wheel
from its axle.

The miller's daughter kept the accounts. She wrote down every sack that came in and
every sack of flour that went out, and the small share the mill kept as its price. She
could tell from the book which farms had a good year and which had a poor one, and she
knew before anyone else when a family was in trouble, because their carts came late
and their sacks were light. More than once she wrote a full sack in the book when the
cart had brought a light one, and said nothing about it to anyone.

When the old miller died, the village expected the mill to be sold. Instead his
daughter kept it, and ran it for forty years, and in all that time the wheel never
stopped for more than a week. She replaced the paddles one by one as they wore out, so
that by the end not a single board of the old wheel remained, and still everyone
called it the old wheel, because it had never once stopped being the same wheel.
""",
    ),
    (
        "A Letter About Counting",
        """\
You asked me how to count the stars, and I must tell you that nobody can, not all of
them. But you can count a small piece of the sky, and that is nearly as good. Take a
cardboard tube from a roll of paper, hold it up to one eye, and point it at a patch of
sky well away from the moon. Count the stars you can see inside the circle. Then
point it somewhere else and count again. Do this ten times, add the numbers, and
divide by ten. Now you know how many stars fit in one circle, on average.

The whole sky is about a certain number of circles wide and a certain number tall,
and if you multiply the average by the number of circles, you have an estimate of all
the stars you could see that night. It will not be exact. It will be wrong by a few
hundred, perhaps. But it will be the right size, and knowing the right size of a thing
is often more useful than knowing its exact value. A sailor does not need to know the
depth of the sea to the inch. He needs to know whether it is deep enough for his boat.

Try it on a clear night, and then try it again on a night with a thin haze, and see
how the number changes. Write both numbers down, with the date and the time. If you do
this for a year, you will know more about your own sky than most people ever learn,
and you will have done it with a cardboard tube and a pencil.
""",
    ),
    (
        "The Walking Path",
        """\
There is a path that leaves the town by the old stone bridge and follows the stream up
into the hills. For the first mile it is wide and flat, and people walk their dogs
there in the evening. After the second gate it narrows and climbs, and only a few
walkers go on. At the top there is a flat rock where you can sit and see the whole
valley: the town, the river, the railway line, the farms laid out like a patchwork
quilt, and on a clear day the sea, a thin bright line at the edge of everything.

I have walked that path in every season. In spring the banks are full of small yellow
flowers and the stream is loud with melted snow. In summer the bracken grows taller
than a child and the air smells of warm earth. In autumn the trees on the lower slope
turn red and gold, one by one, as if someone were painting them slowly. In winter the
path is hard with frost, and the stream is quiet, and you can hear a crow a mile away.

The path does not change much from year to year, but I do, and so each walk is a
little different from the one before. That is the quiet gift of a path you know well.
It holds still, and lets you see how far you have moved.
""",
    ),
]

MONTHS = [
    "January", "February", "March", "April", "May", "June",
    "July", "August", "September", "October", "November", "December",
]
WIND_DIRECTIONS = ["north", "north-east", "east", "south-east", "south", "south-west", "west", "north-west"]
WIND_STRENGTHS = ["a light", "a steady", "a fresh", "a strong", "a gusting", "a gentle", "a cold", "a warm"]
SKIES = [
    "the sky was clear", "the sky was overcast", "low cloud hid the headland",
    "there was fog on the water until noon", "rain came in squalls", "the sky cleared in the afternoon",
    "a thin haze lay over the sea", "snow fell briefly", "the clouds broke at sunset",
]
SEAS = ["calm", "slight", "moderate", "rough", "heavy", "choppy", "glassy"]
VESSELS = [
    "a fishing boat", "a coal barge", "a three-masted schooner", "the mail steamer",
    "two trawlers", "a small yacht", "a grain ship", "the supply boat", "a pilot cutter",
    "a timber ship", "a ferry",
]
VESSEL_ACTIONS = [
    "passed to the west", "came in close to the point", "anchored in the lee of the island",
    "sailed north before dark", "signalled as she passed", "waited off the bar for the tide",
    "turned back toward the harbour", "ran south under full sail",
]
BIRDS = ["gulls", "terns", "cormorants", "a heron", "gannets", "oystercatchers", "a pair of swallows", "starlings"]
CHORES = [
    "cleaned the lens", "oiled the clockwork", "painted the gallery rail", "mended the roof of the store",
    "carried oil up from the shed", "scrubbed the stairs", "checked the spare wicks",
    "polished the brass", "split wood for the stove", "repaired the fence by the path",
    "wrote letters for the supply boat", "replaced a cracked pane in the lantern",
]
CLOSINGS = [
    "The lamp was lit at {hour} and burned steadily all night.",
    "Lit the lamp at {hour}. Wound the clockwork four times before dawn.",
    "The light went on at {hour}; no trouble with the wick.",
    "Lamp lit at {hour}. The lens turned smoothly.",
    "At {hour} the lamp was lit, and the night passed quietly.",
]
HOURS = ["five", "half past five", "six", "half past six", "seven", "half past seven", "eight", "nine"]
ORDINALS = [
    "first", "second", "third", "fourth", "fifth", "sixth", "seventh", "eighth", "ninth", "tenth",
    "eleventh", "twelfth", "thirteenth", "fourteenth", "fifteenth", "sixteenth", "seventeenth",
    "eighteenth", "nineteenth", "twentieth", "twenty-first", "twenty-second", "twenty-third",
    "twenty-fourth", "twenty-fifth", "twenty-sixth", "twenty-seventh", "twenty-eighth",
]


def log_entry(rng: random.Random, month: str, day: str) -> str:
    """One generated log entry: date, weather, sea, traffic, chores, the lamp."""
    sentences = [
        f"The {day} of {month}.",
        f"{rng.choice(WIND_STRENGTHS).capitalize()} wind from the {rng.choice(WIND_DIRECTIONS)}, "
        f"and {rng.choice(SKIES)}.",
        f"The sea was {rng.choice(SEAS)}.",
    ]
    if rng.random() < 0.7:
        sentences.append(f"{rng.choice(VESSELS).capitalize()} {rng.choice(VESSEL_ACTIONS)}.")
    if rng.random() < 0.5:
        sentences.append(f"Saw {rng.choice(BIRDS)} on the rocks below the light.")
    morning_chore, afternoon_chore = rng.sample(CHORES, 2)
    sentences.append(f"In the morning I {morning_chore}, and after noon I {afternoon_chore}.")
    sentences.append(rng.choice(CLOSINGS).format(hour=rng.choice(HOURS)))
    return " ".join(sentences)


def build_corpus() -> str:
    """Return the whole corpus text (deterministic for a fixed ``SEED``)."""
    rng = random.Random(SEED)
    parts = []
    for title, body in ESSAYS:
        parts.append(f"{title}\n\n{body}")
    parts.append("From the Keeper's Log\n")
    for index in range(LOG_ENTRIES):
        month = MONTHS[(index // 35) % len(MONTHS)]
        day = ORDINALS[(index * 3) % len(ORDINALS)]
        parts.append(log_entry(rng, month, day) + "\n")
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only check that corpus.txt is up to date")
    args = parser.parse_args(argv)
    text = build_corpus()
    if args.check:
        current = CORPUS_PATH.read_text(encoding="utf-8") if CORPUS_PATH.exists() else ""
        if current != text:
            print(f"{CORPUS_PATH} is stale; run {Path(__file__).name} to rewrite it", file=sys.stderr)
            return 1
        return 0
    CORPUS_PATH.write_text(text, encoding="utf-8")
    print(f"wrote {CORPUS_PATH} ({len(text.encode('utf-8'))} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
