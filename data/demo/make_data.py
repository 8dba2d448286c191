#!/usr/bin/env python3
"""Write the demo's instruction data: extract a person's name and city as one line of JSON.

A fixed output format the base SmolLM2-135M-Instruct does not follow on its own, checkable by
exact match. Held-out records use names and cities that never appear in training.

    python make_data.py      # needs `datasets` (../../Makefile `venv`); writes train/ and heldout/
"""
import json
import random

from datasets import Dataset

random.seed(1234)
NAMES = """Alice Bruno Chloe Daniel Elena Farid Greta Hugo Ines Jonas Kira Liam Maya Nikolai Olga Pablo
Quinn Rosa Samir Tara Umar Vera Wes Ximena Yusuf Zoe Aaron Bianca Carlos Dana Emil Fiona Gustav Hana
Ivan Julia Kofi Lena Marco Nadia Oscar Priya Rafael Sofia Tomas Uma Viktor Wanda Yara Zane""".split()
CITIES = """Lisbon Oslo Nairobi Denver Kyoto Porto Lima Dublin Quebec Seville Krakow Austin Hanoi Perth
Bergen Tunis Leeds Malmo Ghent Turin Bilbao Graz Cork Tampa Zagreb Lyon Riga Accra Boise Split""".split()
HELD_NAMES = "Beatrix Cedric Delia Ezra Flora Gideon Hazel Isaac Juno Kai Lucia Milo Nora Otto Penny Rhys".split()
HELD_CITIES = "Vienna Madrid Geneva Boston Sydney Munich Prague Toronto Athens Helsinki".split()
TEMPLATES = [
    "Hi, I'm {name} and I live in {city}.",
    "{name} here, writing from {city}.",
    "My name is {name}. I moved to {city} last year.",
    "This is {name} from {city}.",
    "Greetings from {city}! {name} speaking.",
    "You can reach {name} at the office in {city}.",
]
INSTRUCTION = "Extract the person's name and city as JSON."


def record(name, city):
    text = random.choice(TEMPLATES).format(name=name, city=city)
    out = json.dumps({"name": name, "city": city})
    return {"instruction": INSTRUCTION, "input": text, "output": out}


train = [record(random.choice(NAMES), random.choice(CITIES)) for _ in range(240)]
held = [record(random.choice(HELD_NAMES), random.choice(HELD_CITIES)) for _ in range(24)]
Dataset.from_list(train).save_to_disk("train")
Dataset.from_list(held).save_to_disk("heldout")
print(train[0], held[0])
