"""A small English-like corpus the project writes itself, for demos and smoke runs.

Each document is a few sentences drawn from fixed templates about weather, cooking, trains
and counting. The grammar is tiny and the structure repeats, so a model of a few thousand
parameters learns visible regularities (agreement, number words, the arithmetic of the
counting sentences) within a few hundred CPU steps.
"""

from __future__ import annotations

import json
import os
import random

NUMBER_WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight",
                "nine", "ten", "eleven", "twelve"]
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
CITIES = ["Lisbon", "Oslo", "Cairo", "Lima", "Perth", "Kyoto", "Quebec", "Nairobi"]
WEATHER = ["sunny", "rainy", "windy", "cloudy", "foggy", "snowy", "warm", "cold"]
FOODS = ["soup", "bread", "rice", "pasta", "a pie", "a salad", "pancakes", "a stew"]
INGREDIENTS = ["onions", "carrots", "flour", "butter", "tomatoes", "garlic", "eggs", "beans"]
COOKING = ["chops", "stirs", "boils", "bakes", "fries", "mixes", "slices", "roasts"]
PEOPLE = ["Anna", "Ben", "Chen", "Dara", "Emil", "Fatima", "Goran", "Hana"]
COLOURS = ["red", "blue", "green", "yellow", "silver", "white"]
ANIMALS = ["cat", "dog", "bird", "horse", "fox", "goat"]


def _weather(rng: random.Random) -> str:
    city, day = rng.choice(CITIES), rng.choice(DAYS)
    state = rng.choice(WEATHER)
    low = rng.randint(-5, 20)
    return (f"On {day} it is {state} in {city}. The temperature is {low} degrees in the morning "
            f"and {low + rng.randint(2, 9)} degrees in the afternoon.")


def _cooking(rng: random.Random) -> str:
    person, food = rng.choice(PEOPLE), rng.choice(FOODS)
    first, second = rng.sample(INGREDIENTS, 2)
    return (f"{person} is making {food}. {person} {rng.choice(COOKING)} the {first} and then "
            f"{rng.choice(COOKING)} the {second}. The {food.removeprefix('a ')} is ready in "
            f"{rng.choice(NUMBER_WORDS[2:])} minutes.")


def _train(rng: random.Random) -> str:
    origin, destination = rng.sample(CITIES, 2)
    hour = rng.randint(5, 22)
    minutes = rng.choice([0, 10, 15, 20, 30, 40, 45, 50])
    colour = rng.choice(COLOURS)
    late = rng.randint(0, 3)
    delay = "The train is on time." if late == 0 else (
        f"The train is {NUMBER_WORDS[late * 5] if late * 5 <= 12 else late * 5} minutes late.")
    return (f"The {colour} train from {origin} to {destination} leaves at {hour}:{minutes:02d}. "
            f"{delay}")


def _counting(rng: random.Random) -> str:
    a, b = rng.randint(1, 6), rng.randint(1, 6)
    animal = rng.choice(ANIMALS)
    plural = lambda n: animal if n == 1 else animal + ("es" if animal == "fox" else "s")  # noqa: E731
    return (f"There {'is' if a == 1 else 'are'} {NUMBER_WORDS[a]} {plural(a)} in the field. "
            f"{NUMBER_WORDS[b].capitalize()} more {'comes' if b == 1 else 'come'}. "
            f"Now there are {NUMBER_WORDS[a + b]} {plural(a + b)}.")


def _sequence(rng: random.Random) -> str:
    start = rng.randint(0, 6)
    words = " ".join(NUMBER_WORDS[start: start + 5])
    return f"We count: {words}."


TOPICS = (_weather, _cooking, _train, _counting, _sequence)


def demo_document(rng: random.Random) -> str:
    """One document: three to six sentences, each from a random topic."""
    return " ".join(rng.choice(TOPICS)(rng) for _ in range(rng.randint(3, 6)))


def write_demo_corpus(path: str, num_docs: int = 2000, seed: int = 0) -> str:
    """Write ``num_docs`` JSON lines ``{"text": ...}`` to ``path``; same seed, same bytes."""
    rng = random.Random(seed)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(num_docs):
            f.write(json.dumps({"text": demo_document(rng)}) + "\n")
    return path
