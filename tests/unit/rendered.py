"""Parser-level views of generated job files, for tests that prove user values stay data.

- shell_commands(): every simple command of a script, as bash would split it into words (bashlex, a port of
  bash's own parser, for the structure; each word's source text unquoted with POSIX rules), comments excluded.
- sbatch_directives(): the ``#SBATCH`` lines sbatch honours: those before the first line of code.
- intended(): the commands of a script rendered with placeholders, with each placeholder replaced by the value
  it stands for: what the hostile script must parse to, word for word.
"""

from __future__ import annotations

import shlex

import bashlex

__all__ = ["comment_lines", "intended", "sbatch_directives", "shell_commands"]

# bashlex does not implement arithmetic expansion; this one is ddpkit's own text (the Slurm port formula), never
# a user's, so it is replaced by a plain word before parsing.
_ARITHMETIC = "$((20000 + SLURM_JOB_ID % 10000))"

Commands = list[list[str]]


def shell_commands(text: str) -> Commands:
    source = text.replace(_ARITHMETIC, "ARITHMETIC")
    commands: Commands = []

    def walk(node: bashlex.ast.node) -> None:
        if node.kind == "command":
            words = []
            for part in node.parts:
                if part.kind not in ("word", "assignment"):
                    words.append(f"<{part.kind}>")
                    walk(part)
                    continue
                raw = source[part.pos[0]:part.pos[1]]
                if _expands_commands(raw):
                    words.append(raw)  # ddpkit's own $(...): kept as written, its commands walked too
                    for child in getattr(part, "parts", []):
                        walk(child)
                else:
                    (word,) = shlex.split(raw, comments=False, posix=True) or [""]
                    words.append(word)
            commands.append(words)
            return
        for attr in ("parts", "list"):
            for child in getattr(node, attr, None) or []:
                walk(child)
        for attr in ("command", "body", "output"):
            child = getattr(node, attr, None)
            if isinstance(child, bashlex.ast.node):
                walk(child)

    for tree in bashlex.parse(source):
        walk(tree)
    return commands


def _expands_commands(raw: str) -> bool:
    """Whether a word runs a command substitution: ``$(`` or a backtick outside single quotes. (bashlex reports
    substitutions inside single-quoted assignment values too, which bash never runs.)"""
    outside, quote = [], ""
    for ch in raw:
        if quote:
            quote = "" if ch == quote else quote
            if quote == '"':
                outside.append(ch)
        elif ch in "'\"":
            quote = ch
        else:
            outside.append(ch)
    text = "".join(outside)
    return "$(" in text or "`" in text


def sbatch_directives(text: str) -> list[str]:
    """As sbatch reads them: ``#SBATCH`` lines until the first line that is neither a comment nor blank."""
    out = []
    for line in text.split("\n"):
        if line.startswith("#SBATCH"):
            out.append(line)
        elif line.strip() and not line.startswith("#"):
            break
    return out


def comment_lines(text: str, count: int) -> list[str]:
    """The first ``count`` lines by every line-splitting rule Python knows (str.splitlines: \\r, \\x0b, \\x85,
    \\u2028...), which is at least as strict as bash's (only \\n) and YAML's (\\r, \\n, \\x85, \\u2028, \\u2029)."""
    return text.splitlines()[:count]


def intended(template: str, values: dict[str, str]) -> Commands:
    """The commands of ``template`` (rendered with placeholders) with each placeholder replaced by its value."""
    def fill(word: str) -> str:
        for placeholder, value in values.items():
            word = word.replace(placeholder, value)
        return word

    return [[fill(w) for w in cmd] for cmd in shell_commands(template)]
