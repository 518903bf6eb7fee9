"""Writes the evaluation items of tests/data/eval/ (run from the repository root; the JSONL
files are committed, this is how they were made): simple factual and commonsense questions
written for this project, each with 4 options whose wrong ones are drawn from the same
category (seeded), and short questions for the generation task.

    python tests/data/eval/make_items.py
"""

from __future__ import annotations

import json
import random
from pathlib import Path

HERE = Path(__file__).parent

CAPITALS = {
    "France": "Paris", "Germany": "Berlin", "Italy": "Rome", "Spain": "Madrid",
    "Japan": "Tokyo", "China": "Beijing", "Russia": "Moscow", "Egypt": "Cairo",
    "Canada": "Ottawa", "Australia": "Canberra", "Brazil": "Brasilia", "India": "New Delhi",
    "Mexico": "Mexico City", "Greece": "Athens", "Portugal": "Lisbon", "Ireland": "Dublin",
    "Norway": "Oslo", "Sweden": "Stockholm", "Finland": "Helsinki", "Denmark": "Copenhagen",
    "Poland": "Warsaw", "Austria": "Vienna", "Hungary": "Budapest", "Turkey": "Ankara",
    "Kenya": "Nairobi", "Argentina": "Buenos Aires", "Peru": "Lima", "Chile": "Santiago",
    "Thailand": "Bangkok", "South Korea": "Seoul", "Vietnam": "Hanoi", "Cuba": "Havana",
    "the Netherlands": "Amsterdam", "Belgium": "Brussels", "Switzerland": "Bern",
    "the United Kingdom": "London", "the United States": "Washington, D.C.",
    "Iran": "Tehran", "Iraq": "Baghdad", "Indonesia": "Jakarta",
}
OPPOSITES = {
    "hot": "cold", "big": "small", "up": "down", "fast": "slow", "happy": "sad",
    "light": "dark", "open": "closed", "early": "late", "wet": "dry", "full": "empty",
    "hard": "soft", "old": "young", "rich": "poor", "strong": "weak", "high": "low",
    "long": "short", "loud": "quiet", "thick": "thin", "win": "lose", "push": "pull",
    "buy": "sell", "inside": "outside", "first": "last", "day": "night", "heavy": "light",
    "clean": "dirty", "asleep": "awake", "begin": "end", "true": "false", "remember": "forget",
}
YOUNG = {
    "cat": "kitten", "dog": "puppy", "cow": "calf", "horse": "foal", "sheep": "lamb",
    "hen": "chick", "bear": "cub", "pig": "piglet", "duck": "duckling", "kangaroo": "joey",
    "goat": "kid", "frog": "tadpole", "goose": "gosling", "deer": "fawn", "swan": "cygnet",
}
PLURALS = {
    "mouse": "mice", "child": "children", "foot": "feet", "tooth": "teeth", "man": "men",
    "woman": "women", "goose": "geese", "person": "people", "leaf": "leaves", "knife": "knives",
    "box": "boxes", "city": "cities", "baby": "babies", "wolf": "wolves", "ox": "oxen",
    "cactus": "cacti", "potato": "potatoes", "bus": "buses", "half": "halves", "life": "lives",
}
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August",
          "September", "October", "November", "December"]
FACTS = [  # (question, answer, three wrong options)
    ("What color is the sky on a clear day?", "blue", ["green", "red", "brown"]),
    ("What color is fresh grass?", "green", ["blue", "purple", "orange"]),
    ("What color is snow?", "white", ["black", "green", "red"]),
    ("What color is a ripe banana?", "yellow", ["blue", "purple", "gray"]),
    ("What do bees make?", "honey", ["milk", "silk", "wool"]),
    ("Where do fish live?", "in water", ["in trees", "in the desert", "in clouds"]),
    ("What do cows drink?", "water", ["oil", "coffee", "juice"]),
    ("Which animal is known as the king of the jungle?", "the lion", ["the mouse", "the cow",
                                                                      "the rabbit"]),
    ("How many legs does a spider have?", "eight", ["six", "four", "ten"]),
    ("How many legs does a dog have?", "four", ["two", "six", "eight"]),
    ("How many days are in a week?", "seven", ["five", "ten", "twelve"]),
    ("How many months are in a year?", "twelve", ["ten", "seven", "fifty-two"]),
    ("How many hours are in a day?", "twenty-four", ["twelve", "sixty", "one hundred"]),
    ("How many minutes are in an hour?", "sixty", ["twenty-four", "one hundred", "twelve"]),
    ("What do we use to see?", "our eyes", ["our ears", "our feet", "our elbows"]),
    ("What do we use to hear?", "our ears", ["our eyes", "our knees", "our hair"]),
    ("What falls from clouds when it rains?", "water", ["sand", "milk", "stones"]),
    ("What is frozen water called?", "ice", ["steam", "sand", "glass"]),
    ("What gas do people need to breathe?", "oxygen", ["helium", "neon", "smoke"]),
    ("Which planet do we live on?", "Earth", ["Mars", "Jupiter", "Venus"]),
    ("What gives light during the day?", "the Sun", ["the Moon", "a candle", "a lamp post"]),
    ("What do you wear on your feet?", "shoes", ["hats", "gloves", "scarves"]),
    ("What do you wear on your head?", "a hat", ["a shoe", "a sock", "a glove"]),
    ("Where does a bird build its home?", "a nest", ["a cave", "a barn", "a pond"]),
    ("What do you use to cut paper?", "scissors", ["a spoon", "a pillow", "a cup"]),
    ("What do you use to write on paper?", "a pen", ["a fork", "a sock", "a plate"]),
    ("Which season is the coldest?", "winter", ["summer", "spring", "autumn"]),
    ("Which season is the hottest?", "summer", ["winter", "autumn", "spring"]),
    ("What is the largest ocean on Earth?", "the Pacific Ocean", ["the Atlantic Ocean",
                                                                 "the Indian Ocean",
                                                                 "the Arctic Ocean"]),
    ("What do plants need from the Sun to grow?", "light", ["sound", "sand", "salt"]),
    ("Which animal gives us wool?", "the sheep", ["the cat", "the fish", "the snake"]),
    ("Which animal has a very long neck?", "the giraffe", ["the pig", "the rabbit", "the frog"]),
    ("Which animal has a trunk?", "the elephant", ["the horse", "the cat", "the eagle"]),
    ("What do you call a place where books are lent?", "a library", ["a bakery", "a garage",
                                                                   "a stadium"]),
    ("Who treats sick people in a hospital?", "a doctor", ["a pilot", "a baker", "a farmer"]),
    ("Who flies an airplane?", "a pilot", ["a chef", "a dentist", "a tailor"]),
    ("What do you call a baby's bed?", "a crib", ["a sofa", "a bench", "a shelf"]),
    ("Which meal is eaten in the morning?", "breakfast", ["dinner", "supper", "a midnight snack"]),
    ("What do you use to unlock a door?", "a key", ["a spoon", "a brush", "a ruler"]),
    ("What is the boiling point of water at sea level in Celsius?", "100 degrees",
     ["50 degrees", "0 degrees", "212 degrees"]),
]


def choices(answer: str, pool: list[str], rng: random.Random) -> tuple[list[str], int]:
    wrong = rng.sample(sorted(set(pool) - {answer}), 3)
    options = wrong + [answer]
    rng.shuffle(options)
    return options, options.index(answer)


def items() -> list[dict]:
    rng = random.Random(2026)
    out = []

    def add(question, answer, pool, category):
        options, i = choices(answer, pool, rng)
        out.append({"id": len(out), "category": category, "question": question,
                    "choices": options, "answer": i})

    for country, city in CAPITALS.items():
        add(f"What is the capital of {country}?", city, list(CAPITALS.values()), "capital")
    for word, opposite in OPPOSITES.items():
        add(f"What is the opposite of \"{word}\"?", opposite, list(OPPOSITES.values()),
            "opposite")
    for animal, young in YOUNG.items():
        add(f"What is a baby {animal} called?", young, list(YOUNG.values()), "young")
    for word, plural in PLURALS.items():
        add(f"What is the plural of \"{word}\"?", plural, list(PLURALS.values()), "plural")
    for i, day in enumerate(DAYS):
        add(f"Which day comes after {day}?", DAYS[(i + 1) % 7], DAYS, "calendar")
    for i, month in enumerate(MONTHS):
        add(f"Which month comes after {month}?", MONTHS[(i + 1) % 12], MONTHS, "calendar")
    for a, b in [(rng.randint(2, 20), rng.randint(2, 20)) for _ in range(30)]:
        near = [str(a + b + d) for d in (-3, -2, -1, 1, 2, 3)]
        add(f"What is {a} plus {b}?", str(a + b), near + [str(a + b)], "arithmetic")
    for a, b in [(rng.randint(10, 30), rng.randint(1, 9)) for _ in range(20)]:
        near = [str(a - b + d) for d in (-3, -2, -1, 1, 2, 3)]
        add(f"What is {a} minus {b}?", str(a - b), near + [str(a - b)], "arithmetic")
    for question, answer, wrong in FACTS:
        options = wrong + [answer]
        rng.shuffle(options)
        out.append({"id": len(out), "category": "fact", "question": question,
                    "choices": options, "answer": options.index(answer)})
    return out


GENERATION = [  # short questions answered in a sentence (the generation task)
    "What is the capital of France?", "Name three colors of the rainbow.",
    "What do bees make?", "Why do we need sleep?", "What is 12 plus 7?",
    "Name a fruit that is yellow.", "What is the opposite of cold?",
    "How many legs does a spider have?", "What is water made of?",
    "Which planet is closest to the Sun?", "What do plants need to grow?",
    "Name two animals that live in the sea.", "What is the largest ocean?",
    "Why is the sky blue?", "What season comes after winter?",
    "What is a baby cat called?", "Name a musical instrument with strings.",
    "What do you use to write on paper?", "Where do penguins live?",
    "What is the freezing point of water in Celsius?",
]


def main() -> None:
    mc = items()
    (HERE / "mc.jsonl").write_text("".join(json.dumps(x) + "\n" for x in mc))
    gen = [{"id": i, "question": q} for i, q in enumerate(GENERATION)]
    (HERE / "generation.jsonl").write_text("".join(json.dumps(x) + "\n" for x in gen))
    print(f"{len(mc)} multiple-choice items, {len(gen)} generation items")


if __name__ == "__main__":
    main()
