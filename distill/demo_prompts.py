"""Generate the demo domain's prompt set: finance customer service.

    python -m draftsmith.distill.demo_prompts [--out distill/data/finance_prompts.jsonl] [--count 1200]

Prompts are built from term and template lists below: question types (how-to, fees, problems,
disputes, account changes, comparisons, policy), tones (plain, polite, upset, hurried, formal),
lengths (a few words to a paragraph of context) and follow-ups (two-turn chats). The output is
deterministic for a seed; the shipped file is this script's output with the defaults.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

PRODUCTS = [
    "checking account",
    "savings account",
    "credit card",
    "debit card",
    "mortgage",
    "auto loan",
    "personal loan",
    "home equity line of credit",
    "certificate of deposit",
    "brokerage account",
    "Roth IRA",
    "traditional IRA",
    "business checking account",
    "student loan",
    "prepaid card",
    "money market account",
    "joint account",
    "trust account",
    "travel rewards card",
    "secured credit card",
]
ACTIONS = [
    "open",
    "close",
    "transfer money out of",
    "add a beneficiary to",
    "change the address on",
    "set up autopay for",
    "freeze",
    "unfreeze",
    "add an authorized user to",
    "upgrade",
    "link an external account to",
    "order checks for",
    "get statements for",
    "dispute a charge on",
    "raise the limit on",
    "lower the interest rate on",
    "refinance",
    "pay off early",
    "set alerts on",
    "change the PIN for",
]
FEES = [
    "overdraft fee",
    "monthly maintenance fee",
    "foreign transaction fee",
    "wire transfer fee",
    "late payment fee",
    "ATM fee",
    "annual fee",
    "returned payment fee",
    "cash advance fee",
    "early withdrawal penalty",
    "stop payment fee",
    "paper statement fee",
    "balance transfer fee",
    "account closing fee",
    "expedited card delivery fee",
]
PROBLEMS = [
    "my card was declined at a store",
    "I see a charge I don't recognize",
    "my direct deposit hasn't arrived",
    "I was charged twice for the same purchase",
    "my online banking login is locked",
    "the mobile app won't let me deposit a check",
    "my transfer has been pending for three days",
    "I lost my wallet with my cards in it",
    "I got a text saying my account was suspended",
    "my payment didn't post before the due date",
    "the ATM kept my card",
    "my statement balance looks wrong",
    "a merchant refund never showed up",
    "my credit score dropped after I opened a card",
    "I can't find my tax documents",
    "my check bounced even though I had money",
    "I received a card I never applied for",
    "my wire to another country was returned",
    "the interest on my savings is lower than advertised",
    "I was charged interest after paying in full",
]
TOPICS = [
    "APR",
    "APY",
    "minimum payment",
    "grace period",
    "credit utilization",
    "FDIC insurance",
    "routing number",
    "ACH transfer",
    "wire transfer",
    "cashier's check",
    "escrow account",
    "amortization",
    "balance transfer",
    "credit limit",
    "hard inquiry",
    "chargeback",
    "two-factor authentication",
    "overdraft protection",
    "required minimum distribution",
    "compound interest",
    "closing costs",
    "debt-to-income ratio",
    "automatic savings plan",
    "zero-liability policy",
    "rate lock",
]
AMOUNTS = ["$25", "$40", "$120", "$350", "$1,200", "$2,500", "$10,000", "$75,000", "$300", "$15"]
TIMES = [
    "yesterday",
    "last week",
    "this morning",
    "two days ago",
    "on Friday",
    "at the end of last month",
    "over the weekend",
    "an hour ago",
]
PLACES = [
    "a gas station",
    "an online store",
    "a hotel in Spain",
    "a restaurant",
    "a grocery store",
    "an airline",
    "a streaming service",
    "a pharmacy",
    "a car rental desk",
    "a coffee shop",
]
TONES = {
    "plain": ("", ""),
    "polite": ("Hi, ", " Thanks so much for your help."),
    "upset": ("This is really frustrating. ", " I need this fixed today."),
    "hurried": ("Quick question: ", ""),
    "formal": ("Good afternoon. ", " I would appreciate a detailed explanation."),
}
TEMPLATES = {
    "how_to": [
        "How do I {action} my {product}?",
        "What are the steps to {action} a {product}?",
        "Can I {action} my {product} online, or do I need to visit a branch?",
        "I want to {action} my {product}. What do I need to have ready?",
    ],
    "fees": [
        "Why was I charged a {fee} of {amount}?",
        "How can I avoid the {fee} on my {product}?",
        "Is the {fee} refundable if it was my first time?",
        "What is the {fee} for a {product}?",
    ],
    "problem": [
        "{problem} {time}. What should I do?",
        "Help, {problem}.",
        "{problem}, and the amount was {amount}. Can you help?",
        "I think {problem} after I used my card at {place}. What happens now?",
    ],
    "dispute": [
        "I want to dispute a {amount} charge from {place} on my {product}. How does that work?",
        "How long does a chargeback take for a purchase at {place}?",
        "A charge of {amount} from {place} {time} is not mine. How do I report fraud?",
    ],
    "explain": [
        "What does {topic} mean?",
        "Can you explain {topic} in simple terms?",
        "How does {topic} affect my {product}?",
        "What's the difference between {topic} and {topic2}?",
    ],
    "compare": [
        "Should I get a {product} or a {product2}?",
        "What are the pros and cons of a {product} compared with a {product2}?",
        "Which is better for saving {amount} a month: a {product} or a {product2}?",
    ],
    "policy": [
        "What is your policy on {topic}?",
        "Are there limits on how much I can move with an {topic2}?",
        "How long do you keep records of my {product} transactions?",
    ],
}
CONTEXT = [
    "I've been a customer for {years} years. ",
    "I'm traveling abroad next month. ",
    "I just moved to a new state. ",
    "I'm a small business owner. ",
    "My paycheck comes every two weeks. ",
    "I'm helping my elderly parent with their finances. ",
    "I'm a student on a tight budget. ",
    "",
]
FOLLOW_UPS = [
    "Thanks. And how long will that take?",
    "Does that cost anything extra?",
    "Can I do that from the mobile app?",
    "What if that doesn't work?",
    "Will this affect my credit score?",
    "Can you summarize that in three steps?",
    "Is there a phone number I should call instead?",
]


def _fill(template: str, rng: random.Random) -> str:
    product, product2 = rng.sample(PRODUCTS, 2)
    topic, topic2 = rng.sample(TOPICS, 2)
    return template.format(
        product=product,
        product2=product2,
        action=rng.choice(ACTIONS),
        fee=rng.choice(FEES),
        amount=rng.choice(AMOUNTS),
        problem=rng.choice(PROBLEMS),
        time=rng.choice(TIMES),
        place=rng.choice(PLACES),
        topic=topic,
        topic2=topic2,
    )


def make_record(rng: random.Random) -> dict:
    kind = rng.choice(sorted(TEMPLATES))
    question = _fill(rng.choice(TEMPLATES[kind]), rng)
    question = question[0].upper() + question[1:]
    tone = rng.choice(sorted(TONES))
    opening, closing = TONES[tone]
    context = rng.choice(CONTEXT).format(years=rng.randint(1, 25)) if rng.random() < 0.4 else ""
    text = f"{opening}{context}{question}{closing}"
    record = {"kind": kind, "tone": tone}
    if rng.random() < 0.15:  # a follow-up turn: the chat's earlier assistant answer is a short acknowledgement
        record["messages"] = [
            {"role": "user", "content": text},
            {"role": "assistant", "content": "I can help with that. Could you tell me a bit more about what you need?"},
            {"role": "user", "content": rng.choice(FOLLOW_UPS)},
        ]
    else:
        record["prompt"] = text
    return record


def generate(count: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    seen, records = set(), []
    while len(records) < count:
        record = make_record(rng)
        key = json.dumps(record, sort_keys=True)
        if key not in seen:
            seen.add(key)
            records.append({"id": f"fin-{len(records):05d}", **record})
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "data" / "finance_prompts.jsonl")
    parser.add_argument("--count", type=int, default=1200)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    records = generate(args.count, args.seed)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("".join(json.dumps(r) + "\n" for r in records))
    print(f"wrote {len(records)} prompts to {args.out}")


if __name__ == "__main__":
    main()
