"""A lexical guard against the known false hits of semantic caches.

Sentence embeddings put "How do I enable 2FA?" and "How do I disable 2FA?" at a cosine of 0.92, "Convert 5
miles to km" and "Convert 5 km to miles" at 0.99: they encode what a text is about far better than what it
asks. A cache that answered one with the other would be confidently wrong, and a miss only costs one
generation, so `conflict` vetoes a candidate whenever a cheap, deterministic check on the words says the two
questions differ. Each check compares what one text says against the whole of the other, so a word that
only changed case or position is no difference.
"""

from __future__ import annotations

import re
from difflib import SequenceMatcher


def _set(words: str) -> frozenset[str]:
    return frozenset(words.split())


# Lowercase words; contractions stay whole ("doesn't") because they carry negation.
_WORD = re.compile(r"[a-z0-9]+(?:'[a-z]+)?")

_NEGATIONS = _set("""
not no never none nothing nobody nowhere neither nor without cannot
dont doesnt didnt cant wont isnt arent wasnt werent shouldnt wouldnt couldnt havent hasnt
""")

# Antonyms. Verbs are matched inflected too (enabled, enabling, turned off); a phrase inflects its first word.
_VERB_OPPOSITES = """
enable/disable, turn on/turn off, switch on/switch off, log in/log out, sign in/sign out, opt in/opt out,
increase/decrease, add/remove, create/delete, insert/delete, install/uninstall, encrypt/decrypt, encode/decode,
compress/decompress, zip/unzip, start/stop, open/close, buy/sell, upload/download, import/export, lock/unlock,
show/hide, allow/deny, accept/reject, connect/disconnect, mount/unmount, subscribe/unsubscribe, follow/unfollow,
block/unblock, include/exclude, upgrade/downgrade, push/pull, mute/unmute, freeze/unfreeze,
serialize/deserialize, scale up/scale down, zoom in/zoom out, expand/collapse, send/receive, borrow/lend,
win/lose, pass/fail
"""
_WORD_OPPOSITES = """
before/after, min/max, minimum/maximum, above/below, first/last, more/less, more/fewer, most/least,
better/worse, best/worst, faster/slower, fastest/slowest, bigger/smaller, biggest/smallest, larger/smaller,
largest/smallest, higher/lower, highest/lowest, longer/shorter, older/newer, older/younger, cheap/expensive,
ascending/descending, asc/desc, upper/lower, uppercase/lowercase, horizontal/vertical,
horizontally/vertically, local/remote, input/output, inbound/outbound, incoming/outgoing, public/private,
internal/external, online/offline, true/false, positive/negative, valid/invalid, legal/illegal, safe/unsafe,
possible/impossible, hot/cold, warm/cold, early/late, earlier/later, profit/loss, gain/loss, debit/credit,
male/female, north/south, east/west, left/right
"""

# Number words count as the numeral they name, so "three" and "3" agree and "three" and "4" do not.
_NUMBER_WORDS = {w: str(i) for i, w in enumerate(
    ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve"])}
_NUMERAL = re.compile(r"\d+(?:[.,]\d+)*")
# "which one", "this one", "the one": a pronoun, not a count.
_PRONOUN_ONE = re.compile(r"\b(?:which|this|that|each|every|any|the|no|some|another|other|one|single) one\b")

# A capitalized word that does not open a sentence (or a "user:" line) is taken for a name.
_CAPITALIZED = re.compile(r"(?<![\w'-])[A-Z][\w'.+#-]*")  # not the O of "big-O"
_NOT_NAMES = frozenset({"I", "I'm", "I've", "I'd", "I'll"})

# Quoted strings and code identifiers: dotted.names, snake_case, camelCase, --flags, calls().
_QUOTED = re.compile(r"`([^`]+)`|\"([^\"]+)\"|“([^”]+)”|(?<![\w'])'([^']+)'(?![\w'])")
_IDENTIFIER = re.compile(r"\b[A-Za-z_]\w*(?:(?:\.|::|->)[A-Za-z_]\w*)+|\b[a-z]+(?:[A-Z][a-z0-9]*)+\b"
                         r"|\b\w*[a-zA-Z]_\w+\b|(?<![\w-])--?[a-z][\w-]*|\b\w+\(\)")

# Function words: what is left when they are removed is what a question is about.
_STOPWORDS = _set("""
a an the i me my mine we us our you your it its this that these those is are was were be been being am
do does did can could should would will shall may might must have has had how what what's which who why
when where there here to of in on at for from by with about as into than then so and or but if please
some any just also very really way best steps step possible tell explain give show get i'm let's
want need like know help tips usually typically typical actually exactly basically generally simply kindly
using getting got calculate one
""")
# Words that make an order of terms irrelevant: "Python vs Rust" is "Rust vs Python".
_SYMMETRIC = _set("and or vs versus between compare comparison difference")
# Swapping one of these for another in the same group keeps the question.
_SYNONYMS = [_set(group) for group in """
add create make new
delete remove erase
big large huge
small little tiny
fix repair solve resolve
begin start
change update modify edit
quick quickly fast
find locate search
read load
""".strip().splitlines()]


def _inflections(verb: str) -> set[str]:
    """enable -> enables, enabled, enabling; stop -> stopped, stopping; a phrase inflects its first word.
    A few forms generated this way are not words ("openned"): they never match, so they do no harm."""
    head, _, rest = verb.partition(" ")
    stem = head[:-1] if head.endswith("e") else head
    heads = {head, head + "s", head + "es", head + "d", stem + "ed", stem + "ing",
             head + head[-1] + "ed", head + head[-1] + "ing"}
    return {f"{h} {rest}".strip() for h in heads}


def _table(text: str, inflect: bool) -> list[tuple[set[str], set[str]]]:
    pairs = []
    for cell in text.replace("\n", " ").split(","):
        a, b = (side.strip() for side in cell.split("/"))
        pairs.append((_inflections(a), _inflections(b)) if inflect else ({a}, {b}))
    return pairs


_OPPOSITES = _table(_VERB_OPPOSITES, inflect=True) + _table(_WORD_OPPOSITES, inflect=False)


def _words(text: str) -> list[str]:
    text = re.sub(r"(?<=\d),(?=\d{3}(?!\d))", "", text.lower().replace("’", "'").replace("%", " percent "))
    return _WORD.findall(text)  # 1,000 is 1000


def _canonical(words: list[str]) -> list[str]:
    """Number words as numerals, for the checks that compare word by word: "three" is "3"."""
    return [_NUMBER_WORDS.get(w, w) for w in words]


def _has(joined: str, forms: set[str]) -> bool:
    """Any of `forms` (words or phrases) on word boundaries of `joined` (words separated by single spaces)."""
    return any(f" {form} " in joined for form in forms)


def _negated(words: list[str]) -> bool:
    return any(w in _NEGATIONS or w.endswith("n't") for w in words)


def _opposite(a_words: list[str], b_words: list[str]) -> str | None:
    a, b = f" {' '.join(a_words)} ", f" {' '.join(b_words)} "
    for left, right in _OPPOSITES:
        # One side only in one text, the other only in the other: "start and stop" vs "stop" is no conflict.
        for x, y in ((a, b), (b, a)):
            if _has(x, left) and not _has(y, left) and _has(y, right) and not _has(x, right):
                return f"opposite: {min(left, key=len)} / {min(right, key=len)}"
    return None


def _numbers(text: str, words: list[str]) -> set[str]:
    found = {re.sub(r",(?=\d{3}(?!\d))", "", n) for n in _NUMERAL.findall(text)}
    counted = _PRONOUN_ONE.sub(" ", " ".join(words)).split()
    return found | {_NUMBER_WORDS[w] for w in counted if w in _NUMBER_WORDS}


def _names(text: str) -> set[str]:
    names = set()
    for match in _CAPITALIZED.finditer(text):
        before = text[:match.start()].rstrip(" \t\"'(`“")
        opens_sentence = not before or before[-1] in ".!?:;\n"
        name = re.sub(r"('s|[.'-])+$", "", match.group())
        if not opens_sentence and name and name not in _NOT_NAMES:
            names.add(name)
    return names


def _missing_name(a: str, b: str, b_words: set[str]) -> str | None:
    """A name in `a` whose words do not all appear in `b`, in any case or position. Symbols count in names
    that have them: C++ and C# are not C."""
    for name in sorted(_names(a)):
        if not set(_words(name)) <= b_words or (re.search(r"[+#]", name) and name.lower() not in b.lower()):
            return name
    return None


def _code(text: str) -> set[str]:
    quoted = {next(g for g in m.groups() if g is not None) for m in _QUOTED.finditer(text)}
    identifiers = {m.group() for m in _IDENTIFIER.finditer(text) if len(m.group()) >= 4}  # not "e.g"
    return {s.lower() for s in quoted | identifiers}


def _content(words: list[str]) -> list[str]:
    return [w.removesuffix("'s") for w in _canonical([w for w in words if w not in _STOPWORDS])]


def _plural_stem(word: str) -> str:
    for suffix, replacement in (("ies", "y"), ("es", ""), ("s", "")):
        if word.endswith(suffix) and len(word) > len(suffix) + 2:
            return word[:-len(suffix)] + replacement
    return word


def _same_word(x: str, y: str) -> bool:
    """A plural, a typo or a synonym: "dictionaries"/"dictionary", "pasword"/"password", "delete"/"remove".
    Not merely similar spelling: "teaspoon"/"tablespoon" (0.78) are two words."""
    x_stem, y_stem = _plural_stem(x), _plural_stem(y)
    return (x_stem in (y, y_stem) or x in (y, y_stem) or SequenceMatcher(None, x, y).ratio() >= 0.85
            or any(x in g and y in g for g in _SYNONYMS))


def _reordered(a: list[str], b: list[str]) -> str | None:
    """Word for word the same text but for two words swapped: who does what to whom changed ("5 miles to
    km" / "5 km to miles"; "is Java faster than Python" / "is Python faster than Java"). Whole texts, not
    only their content words: "a list in Python" and "a Python list" are the same list."""
    if len(a) != len(b) or _SYMMETRIC & set(a):
        return None
    diff = [i for i, (x, y) in enumerate(zip(a, b, strict=True)) if not _same_word(x, y)]
    # Crossed, up to inflection: "teaspoons in a tablespoon" / "tablespoons in a teaspoon".
    if len(diff) == 2 and _same_word(a[diff[0]], b[diff[1]]) and _same_word(a[diff[1]], b[diff[0]]):
        return f"reversed order: {a[diff[0]]} / {a[diff[1]]}"
    return None


def _swapped(a: list[str], b: list[str]) -> str | None:
    """Word for word the same question but for one content word: the slot of a template ("can cats eat
    tuna" / "can dogs eat tuna", "count the words" / "count the lines"). The shared words make the
    embeddings close (up to 0.9) while the one that differs is the whole question."""
    if len(a) != len(b):
        return None
    diff = [(x, y) for x, y in zip(a, b, strict=True) if x != y]
    if len(diff) == 1 and not _same_word(*diff[0]):
        return f"one word changed: {diff[0][0]} / {diff[0][1]}"
    return None


def _narrowed(a: list[str], b: list[str]) -> str | None:
    """One question is the other with more said: "is it safe to take ibuprofen" / "... while pregnant",
    "how do I sort a dictionary" / "... by value". The answer to the general question does not answer the
    narrower one (up to 0.95 apart), nor the other way round."""
    a_set, b_set = set(a), set(b)
    if a_set < b_set or b_set < a_set:
        return f"one says more: {' '.join(sorted(a_set ^ b_set))}"
    return None


def conflict(query: str, cached: str) -> str | None:
    """Why `cached` must not answer `query` although their embeddings are close, or None if nothing says so."""
    q_words, c_words = _words(query), _words(cached)
    if _negated(q_words) != _negated(c_words):
        return "negation in one only"
    if reason := _opposite(q_words, c_words):
        return reason
    q_numbers, c_numbers = _numbers(query, q_words), _numbers(cached, c_words)
    if q_numbers != c_numbers:
        return f"numbers differ: {sorted(q_numbers ^ c_numbers)}"
    if name := _missing_name(query, cached, set(c_words)) or _missing_name(cached, query, set(q_words)):
        return f"name in one only: {name}"
    q_code, c_code = _code(query), _code(cached)
    if missing := [s for s in q_code if s not in cached.lower()] + [s for s in c_code if s not in query.lower()]:
        return f"quoted text or identifier in one only: {sorted(missing)[0]}"
    if reason := _reordered(_canonical(q_words), _canonical(c_words)):
        return reason
    q_content, c_content = _content(q_words), _content(c_words)
    return _swapped(q_content, c_content) or _narrowed(q_content, c_content)
