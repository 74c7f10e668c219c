"""Kernel source text as MLX is handed it: the same tokens without comments and blank runs."""

from __future__ import annotations


def compact_source(text: str) -> str:
    """C / CUDA / Metal source without its comments, blank lines and runs of blanks: the same
    tokens, line by line (preprocessor lines and macro continuations keep their lines).

    Why: MLX's CUDA backend hashes a custom kernel's whole source every time it evaluates a call
    (`CustomKernel::eval_gpu` names the JIT module by std::hash of the source: mlx 0.32,
    mlx/backend/cuda/custom_kernel.cpp), so the host pays for the comments at every launch: the
    small-M matmul's text is ~14 KB, and a 9B decode step calls it 129 times."""
    out: list[str] = []  # characters and pieces of the result
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c in "\"'":  # a string or character literal, copied as it is
            j = i + 1
            while j < n and text[j] != c:
                j += 2 if text[j] == "\\" else 1
            out.append(text[i : j + 1])
            i = j + 1
        elif text.startswith("//", i):
            j = text.find("\n", i)
            i = n if j < 0 else j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            if j < 0:
                raise ValueError("an unterminated /* comment in a kernel source")
            i = j + 2
            if not out or out[-1] != " ":
                out.append(" ")
        elif c in " \t":
            while i < n and text[i] in " \t":
                i += 1
            if not out or out[-1] != " ":
                out.append(" ")
        else:
            out.append(c)
            i += 1
    lines: list[str] = []
    for line in "".join(out).split("\n"):
        line = line.strip()
        # an empty line ends a macro whose last line continues with a backslash: keep it there
        if line or (lines and lines[-1].endswith("\\")):
            lines.append(line)
    return "\n".join(lines) + "\n"
