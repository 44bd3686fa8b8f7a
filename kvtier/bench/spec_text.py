"""Text of two kinds for speculative decoding, drawn from a seed: an agent's tool calls and prose.

A tool-call document is one agent turn as a chat transcript: a system prompt listing some
tools (JSON schemas), a user request that names the arguments, then the assistant's JSON
calls (names and argument values copied from the prompt), the tools' results, and a short
reply. Prose is sentences of words drawn uniformly from lists of a few dozen to a hundred:
every content word is about 6 bits of surprise that no model can predict. The first is what
makes speculation pay in production (a call is mostly copied or fixed syntax), the second
what it gains little on.

`kvtier bench engine --speculative` decodes after `prompt(kind, i)`, and
`bench/spec_pair.py` trains a target and a draft model on `document(kind, seed)`s of
other seeds (the same distribution, never the same text).
"""
from __future__ import annotations

import json
import random

KINDS = ("tool", "text")

# name -> (parameters: name -> kind of value, how a user asks for it)
_TOOLS: dict[str, tuple[dict[str, str], str]] = {
    "get_weather": ({"city": "city", "unit": "unit"}, "What is the weather in {city} in {unit}?"),
    "search_flights": ({"origin": "city", "destination": "city", "date": "date"},
                       "Find me a flight from {origin} to {destination} on {date}."),
    "book_hotel": ({"city": "city", "check_in": "date", "nights": "count"},
                   "Book a hotel in {city} from {check_in} for {nights} nights."),
    "send_email": ({"to": "email", "subject": "topic"}, "Email {to} about {subject}."),
    "create_event": ({"title": "topic", "date": "date", "attendees": "count"},
                     "Put {title} on the calendar for {date} with {attendees} people."),
    "lookup_customer": ({"customer_id": "id"}, "Look up customer {customer_id}."),
    "refund_order": ({"order_id": "id", "amount": "amount"}, "Refund {amount} dollars on order {order_id}."),
    "translate_text": ({"text": "topic", "language": "language"}, "Translate {text} into {language}."),
    "convert_currency": ({"amount": "amount", "from": "currency", "to": "currency"},
                         "Convert {amount} {from} to {to}."),
    "get_stock_price": ({"symbol": "symbol"}, "What is {symbol} trading at?"),
    "set_reminder": ({"text": "topic", "date": "date"}, "Remind me about {text} on {date}."),
    "track_package": ({"tracking_id": "id"}, "Where is package {tracking_id}?"),
}

_CITIES = ("Lisbon", "Oslo", "Nairobi", "Lima", "Osaka", "Denver", "Krakow", "Porto", "Hanoi", "Quito", "Perth",
           "Tunis", "Bergen", "Austin", "Seville", "Malmo", "Cusco", "Dakar", "Leeds", "Turin", "Busan", "Tampa")
_TOPICS = ("the budget review", "the launch plan", "a dentist visit", "the quarterly report", "the team lunch",
           "the contract renewal", "a server outage", "the design sketch", "the hiring plan", "a birthday party")
_NAMES = ("ana", "bo", "chen", "dara", "eli", "femi", "gus", "hana", "ivo", "jun", "kai", "lena", "milo", "nia")
_LANGUAGES = ("French", "Swahili", "Korean", "Polish", "Spanish", "Hindi", "Dutch", "Greek")
_CURRENCIES = ("USD", "EUR", "JPY", "GBP", "KES", "BRL", "INR", "CHF")
_SYMBOLS = ("ACME", "GLOBX", "INITech", "UMBR", "WAYNE", "STARK", "HOOLI", "VANDL")

_ADJ = ("quiet", "bright", "narrow", "ancient", "restless", "golden", "hollow", "gentle", "bitter", "distant",
        "crooked", "silver", "patient", "frozen", "tired", "wild", "humble", "heavy", "pale", "swift", "muddy",
        "hidden", "broken", "tender", "proud", "empty", "curious", "salty", "velvet", "stubborn")
_NOUN = ("river", "lantern", "orchard", "ferry", "market", "clock", "letter", "bridge", "harbor", "kettle",
         "village", "meadow", "window", "sailor", "baker", "tower", "garden", "road", "mirror", "island",
         "forest", "teacher", "painter", "wagon", "valley", "candle", "shepherd", "cellar", "kitchen", "station",
         "mountain", "fisherman", "library", "chapel", "stranger", "courtyard", "workshop", "blanket", "compass",
         "festival")
_VERB = ("watched", "carried", "followed", "remembered", "painted", "crossed", "forgot", "repaired", "found",
         "visited", "guarded", "praised", "opened", "lifted", "measured", "described", "ignored", "traded",
         "admired", "buried", "washed", "counted", "mended", "chased", "sold", "borrowed", "noticed", "wrapped")
_PREP = ("near", "behind", "beyond", "under", "beside", "across", "above", "inside")
_WHEN = ("At dawn", "Later that evening", "Every winter", "By noon", "Long ago", "Once again", "That spring",
         "After the rain")


def document(kind: str, seed: int) -> str:
    """One whole document of `kind` ("tool" or "text"), the same for the same seed."""
    rng = random.Random(f"{kind}:{seed}")
    return _tool_turn(rng) if kind == "tool" else _prose(rng, 12)


def prompt(kind: str, i: int) -> str:
    """The start of document i of `kind`, cut where the model has to go on by itself: a tool
    turn up to the assistant's first call, prose after its first four sentences. Seeds from
    2**31 on, so no prompt is a training document (bench/spec_pair.py uses seeds below).

    Each cut ends a pre-token of a byte-level BPE (a newline after a role tag, as chat
    templates do; a full stop before the space that starts the next word), so the prompt's
    last tokens are the ones the text has there in training, not a fragment of a merge."""
    doc = document(kind, 2**31 + i)
    if kind == "tool":
        return doc[:doc.index("<assistant>\n") + len("<assistant>\n")]
    return ". ".join(doc.split(". ")[:4]) + "."


def _value(kind: str, rng: random.Random) -> str | int:
    if kind == "city":
        return rng.choice(_CITIES)
    if kind == "date":
        return f"2026-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"
    if kind == "count":
        return rng.randint(1, 9)
    if kind == "amount":
        return rng.randint(5, 990)
    if kind == "id":
        return f"{rng.choice('ABCKMRTX')}{rng.randint(10000, 99999)}"
    if kind == "email":
        return f"{rng.choice(_NAMES)}@{rng.choice(('example.com', 'mail.org', 'corp.net'))}"
    if kind == "topic":
        return rng.choice(_TOPICS)
    if kind == "unit":
        return rng.choice(("celsius", "fahrenheit"))
    if kind == "language":
        return rng.choice(_LANGUAGES)
    if kind == "currency":
        return rng.choice(_CURRENCIES)
    return rng.choice(_SYMBOLS)


def _result(name: str, rng: random.Random) -> dict[str, object]:
    """What a tool answers: a status and one or two values a model cannot guess."""
    if name == "get_weather":
        return {"temperature": rng.randint(-10, 35), "sky": rng.choice(("clear", "cloudy", "rain", "snow"))}
    if name in ("search_flights", "book_hotel"):
        return {"status": "ok", "price": rng.randint(80, 900), "ref": f"Q{rng.randint(1000, 9999)}"}
    return {"status": rng.choice(("ok", "ok", "ok", "pending")), "ref": f"Q{rng.randint(1000, 9999)}"}


def _tool_turn(rng: random.Random) -> str:
    offered = rng.sample(sorted(_TOOLS), rng.randint(4, 7))
    schemas = "\n".join(json.dumps({"name": t, "parameters": {"type": "object", "properties":
                                    {p: {"type": "integer" if k in ("count", "amount") else "string"}
                                     for p, k in _TOOLS[t][0].items()}}}) for t in offered)
    chosen = rng.sample(offered, rng.randint(1, 3))
    calls = []
    for t in chosen:
        params, ask = _TOOLS[t]
        args = {p: _value(k, rng) for p, k in params.items()}
        calls.append((t, args, ask.format(**args)))
    out = [f"<system>\nYou are an agent. Call tools with JSON. Tools:\n{schemas}\n",
           "<user>\n" + " ".join(ask for _, _, ask in calls) + "\n"]
    for t, args, _ in calls:
        out.append("<assistant>\n" + json.dumps({"name": t, "arguments": args}) + "\n")
        out.append("<tool>\n" + json.dumps(_result(t, rng)) + "\n")
    out.append("<assistant>\nDone: " + ", ".join(t.replace("_", " ") for t, _, _ in calls) + ".\n")
    return "".join(out)


def _prose(rng: random.Random, sentences: int) -> str:
    out = []
    for _ in range(sentences):
        s = (f"{rng.choice(_WHEN)} the {rng.choice(_ADJ)} {rng.choice(_NOUN)} {rng.choice(_VERB)} the "
             f"{rng.choice(_NOUN)} {rng.choice(_PREP)} the {rng.choice(_ADJ)} {rng.choice(_NOUN)}")
        out.append(s)
    return ". ".join(out) + ".\n"
