#!/usr/bin/env python3
"""Synthetic user prompts (chat, code, math) whose target-model answers become drafter training
text (`dspark gen-data`). Seeded, so the set is rebuilt, not committed; prompts that appear in
the evaluation sets under prompts/ (and prompts/heldout/) are dropped, and
tasks that the evaluation sets ask (factorial, palindrome, Fibonacci, stack, train speed, percentages,
linear equations, fractions) are left out of the templates."""
import random, sys, pathlib

rng = random.Random(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
root = pathlib.Path(__file__).resolve().parent.parent
held_out = set()
for d in ("prompts", "prompts/heldout"):
    for f in ("chat.txt", "code.txt", "math.txt"):
        held_out |= {l.strip() for l in (root / d / f).read_text().splitlines() if l.strip()}

topics = ["photosynthesis", "black holes", "the water cycle", "inflation", "vaccines", "the French Revolution",
    "machine learning", "climate change", "volcanoes", "the immune system", "blockchains", "gravity",
    "the Roman Empire", "electric cars", "sleep", "coffee", "the stock market", "rainbows", "earthquakes",
    "the internet", "democracy", "bees", "the moon landing", "recycling", "meditation", "tides", "DNA",
    "solar panels", "the Renaissance", "jazz music", "chess", "marathon training", "budgeting", "compound interest",
    "the printing press", "antibiotics", "hurricanes", "quantum computing", "ancient Egypt", "coral reefs"]
chat_forms = ["Explain {t} to a ten-year-old.", "What are three interesting facts about {t}?",
    "Write a short paragraph about {t}.", "Why is {t} important?", "Give me a simple summary of {t}.",
    "What are the pros and cons of {t}?", "How would you describe {t} in one sentence?",
    "Write a haiku about {t}.", "What is a common misconception about {t}?", "Tell me a story involving {t}."]
advice = ["stay focused while studying", "make friends in a new city", "cook rice", "start running",
    "write a cover letter", "keep houseplants alive", "save money on groceries", "learn a new language",
    "prepare for a job interview", "reduce stress at work", "organize my closet", "plan a birthday party"]
advice_forms = ["How can I {a}?", "Give me some tips to {a}.", "What is the best way to {a}?"]

tasks = ["reverses a string", "checks whether a number is prime", "merges two sorted lists", "counts the words in a text", "finds the maximum in a list",
    "removes duplicates from a list", 
    "sorts a list with bubble sort", "converts Celsius to Fahrenheit", "flattens a nested list",
    "computes the greatest common divisor", "parses a CSV line", "implements binary search",
    "counts vowels in a string", "transposes a matrix", "reads a file and prints its lines",
    "validates an email address", "computes the mean and median of a list", 
    "rotates an array by k positions", "finds the second largest number", "generates all subsets of a set"]
langs = ["Python", "Rust", "JavaScript", "C", "Go", "Java"]
code_forms = ["Write a {l} function that {t}.", "Implement a {l} program that {t}.",
    "Show me {l} code that {t}.", "In {l}, write a function that {t}, with a short explanation."]
code_misc = ["Explain what a closure is in {l} with an example.", "What is the difference between a list and a tuple in Python?",
    "How do I handle errors in {l}?", "Explain recursion with a {l} example.", "What does a hash map do? Show it in {l}."]

def math_prompt():
    a, b, c = rng.randint(2, 99), rng.randint(2, 99), rng.randint(2, 20)
    forms = [f"What is {a} + {b}?", f"What is {a} times {c}?", f"Compute {a} * {b} - {c}.",
        f"Find x if x - {c} = {a}.",
        f"A shop sells pens for {c} dollars each. How much do {a} pens cost?",
        f"What is the area of a rectangle with sides {a} and {b}?",
        f"Tom has {a} apples and gives away {min(a - 1, c)}. How many are left?",
        f"What is the square of {a}?", f"What is {a * c} divided by {c}?",
        f"Is {a * b + 1} a prime number? Explain.", f"What is the perimeter of a square with side {a}?",
        f"Convert {a * 100} minutes to hours and minutes.", f"What is the average of {a}, {b} and {c}?",
        f"A recipe needs {c} eggs for {a % 6 + 2} people. How many eggs for {b % 10 + 3} people?"]
    return rng.choice(forms)

out = set()
for t in topics:
    for f in chat_forms:
        out.add(f.format(t=t))
for a in advice:
    for f in advice_forms:
        out.add(f.format(a=a))
for t in tasks:
    for l in rng.sample(langs, 3):
        out.add(rng.choice(code_forms).format(l=l, t=t))
for l in langs:
    for f in code_misc:
        out.add(f.format(l=l))
while len(out) < 900:
    out.add(math_prompt())
prompts = sorted(p for p in out if p not in held_out)
rng.shuffle(prompts)
print("\n".join(prompts))
