"""The README: the set-up block CI reads (under "From source"), every figure citing a BENCHMARKS.md
section that exists with the date of its run, links that resolve in the repository, the sections a
ComfyUI user looks for."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text(encoding="utf-8")


def test_setup_block_has_the_demo_and_the_test_command_each_in_its_own_venv():
    block = README.split("## From source", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    lines = [ln for ln in block.splitlines() if ln.strip()]
    comments = [i for i, ln in enumerate(lines) if ln.startswith("#")]
    assert [lines[i].split()[1] for i in comments] == ["main", "tests"]
    for i in comments:
        command = lines[i + 1]
        assert command.startswith("python3 -m venv ")
        assert " -m pip install " in command
    assert lines[comments[0] + 1].endswith("-m adaptive_sparse_attention demo")
    assert lines[comments[1] + 1].endswith("-m pytest tests")


DATE = r"\d{4}-\d{2}-\d{2}"
# A citation: a quoted BENCHMARKS.md section title (the start of a heading is enough) and the date of
# the run, e.g. "End to end in real ComfyUI", 2026-12-01.
CITATION = re.compile(rf'"([^"\n]+)",? ({DATE})')
# A figure: a number with a unit of speed, time, memory, rate or share (1.98x, 34.1 s, 825 ms, 15.90 GiB,
# 24 GB, 560 TFLOP/s, 1.1%). A number glued to a following letter or digit (1344x768, 4x4x4) is none.
FIGURE = re.compile(r"(?<![\w.])\d[\d,]*(?:\.\d+)?\s?(?:TFLOP/s|TFLOPS|TOPS|GB/s|GiB|GB|ms|s|x|%)(?![\w/])")


def benchmark_sections(text: str) -> dict[str, str]:
    """BENCHMARKS.md's sections: heading (without the `#`s) -> the heading and its text up to the next
    heading of the same or a higher level."""
    text = re.sub(r"^```.*?^```", lambda m: re.sub(r"^#", " ", m.group(0), flags=re.M), text,
                  flags=re.M | re.S)  # comment lines in code blocks are no headings
    heads = list(re.finditer(r"^(#+) (.+)$", text, re.M))
    sections = {}
    for i, head in enumerate(heads):
        level = len(head.group(1))
        end = next((h.start() for h in heads[i + 1:] if len(h.group(1)) <= level), len(text))
        sections[head.group(2)] = text[head.start():end]
    return sections


def citation_errors(text: str, sections: dict[str, str]) -> list[str]:
    """Each citation in `text` whose title starts no BENCHMARKS.md heading, or whose date does not
    occur in that section (heading or text)."""
    errors = []
    for title, date in CITATION.findall(re.sub(r"\s+", " ", text)):
        found = [body for heading, body in sections.items() if heading.startswith(title)]
        if not found:
            errors.append(f'"{title}": no BENCHMARKS.md section starts with this title')
        elif not any(date in body for body in found):
            errors.append(f'"{title}", {date}: the section holds no run of that date')
    return errors


def units(text: str) -> list[tuple[str, str]]:
    """The README cut into (unit, the text that may cite for it): a unit is a paragraph, a list item or a
    table; a table and the paragraph right above it (its caption) cite for each other, except a table
    with a "BENCHMARKS.md" column, each of whose rows is a unit that cites for itself. Code blocks and
    inline code are left out (commands, not figures); a heading is a unit of its own."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
    text = re.sub(r"`[^`\n]*`", "`code`", text)
    blocks, current = [], []
    for line in text.splitlines() + [""]:
        starts = (not line.strip() or line.startswith("#") or re.match(r"(- |\* |\d+\. )", line)
                  or (line.startswith("|") != (bool(current) and current[-1].startswith("|"))))
        if starts and current:
            blocks.append("\n".join(current))
            current = []
        if line.strip():
            current.append(line)
        if line.startswith("#") and current:
            blocks.append(current.pop())
    def captioned(i: int) -> bool:  # block i is a table with a paragraph right above it
        return i > 0 and blocks[i].startswith("|") and not blocks[i - 1].startswith(("|", "#"))

    out = []
    for i, block in enumerate(blocks):
        header = block.split("\n", 1)[0]
        if block.startswith("|") and "BENCHMARKS.md" in header:  # a column of sections: each row cites its own
            out += [(row, row) for row in block.split("\n")[2:]]
            continue
        pair = [i - 1, i] if captioned(i) else [i, i + 1] if i + 1 < len(blocks) and captioned(i + 1) else [i]
        out.append((block, "\n".join(blocks[j] for j in pair)))
    return out


def uncited_figures(text: str) -> list[str]:
    """The units of `text` that hold a figure but no citation (a table: nor its caption)."""
    return [block[:120] for block, citable in units(text)
            if FIGURE.search(block) and not CITATION.search(re.sub(r"\s+", " ", citable))]


SECTIONS = benchmark_sections((ROOT / "BENCHMARKS.md").read_text(encoding="utf-8"))


def test_every_readme_figure_cites_a_benchmark_section_with_its_date():
    """The rule: every paragraph, list item or table of the README that holds a figure (a number with
    x, ms, s, GiB, GB, TFLOP/s or %) names a BENCHMARKS.md section as `"<title>", <date>` (a table may
    name it in the paragraph right above it; in a table with a "BENCHMARKS.md" column, every row with a
    figure names its own); every such title starts a heading of BENCHMARKS.md and its date occurs in
    that section."""
    assert not uncited_figures(README), uncited_figures(README)
    cited = CITATION.findall(re.sub(r"\s+", " ", README))
    assert len(cited) >= 5
    assert not citation_errors(README, SECTIONS)
    bare = re.findall(rf'BENCHMARKS\.md,? "[^"]+"(?!,? {DATE})', re.sub(r"\s+", " ", README))
    assert not bare, f"cited without a date: {bare}"


def test_the_figure_rule_fails_on_made_up_or_missing_citations():
    made_up = 'The node was 9.99x faster (BENCHMARKS.md, "A section nobody wrote", 2026-12-01).\n'
    assert citation_errors(made_up, SECTIONS) == ['"A section nobody wrote": no BENCHMARKS.md section starts '
                                                  'with this title']
    wrong_date = 'It took 37.1 s (BENCHMARKS.md, "End to end in real ComfyUI", 2025-01-01).\n'
    assert citation_errors(wrong_date, SECTIONS)
    assert uncited_figures("Intro.\n\nThe run took 37.1 s on the H200.\n")
    assert uncited_figures("| run | s |\n|---|---|\n| ours | 37.1 s |\n")
    assert not uncited_figures('Measured (BENCHMARKS.md, "End to end in real ComfyUI", 2026-12-01):\n\n'
                               "| run | s |\n|---|---|\n| ours | 37.1 s |\n")
    assert not uncited_figures("1344x768 frames, `--clips 5s,10s`, 56 heads x 128.\n")
    cited_row = '| ours | 37.1 s | "End to end in real ComfyUI", 2026-12-01 |\n'
    table = "| run | s | BENCHMARKS.md section |\n|---|---|---|\n" + cited_row
    assert not uncited_figures(table)
    assert uncited_figures(table + "| a new row | 9.9 s | |\n")
    assert uncited_figures("- one item, cited (BENCHMARKS.md, \"End to end in real ComfyUI\", 2026-12-01)\n"
                           "- another with 2.16x and no citation\n")


def test_links_stay_inside_the_repository():
    assert "../" not in README
    assert not re.search(r"\bissues? \d+", README, re.I)
    for target in re.findall(r"\]\(([^)#]+)\)", README):
        if not target.startswith(("http://", "https://")):
            assert (ROOT / target).exists(), f"README links to {target}, which is not in the repository"


def section(title: str) -> str:
    """The text under a heading (any level) up to the next heading of the same or a higher level."""
    text = re.sub(r"^```.*?^```", lambda m: re.sub(r"^#", " ", m.group(0), flags=re.M), README,
                  flags=re.M | re.S)  # comment lines in code blocks are no headings
    match = re.search(rf"^(#+) {re.escape(title)}\n", text, re.M)
    assert match, f"README has no section {title!r}"
    level = len(match.group(1))
    rest = text[match.end():]
    end = re.search(rf"^#{{1,{level}}} ", rest, re.M)
    return rest[:end.start()] if end else rest


def test_sections_for_a_home_setup():
    """What a ComfyUI user looks for: their GPU (the RTX figures marked as a projection, the Hopper
    share separated), VRAM, what they already run, models and the minimum ComfyUI, troubleshooting."""
    gpu = section("What to expect on your GPU")
    rtx = section("RTX 30, 40 and 50 series: a projection, not a measurement")
    assert "not a measurement" in gpu
    assert "Projection" in rtx
    assert "not measured" in rtx
    assert "1.44x" in section("What part of the H200's gain is Hopper's own")
    assert "not measured" in section("VRAM").lower()
    for title in ("SageAttention, `--use-sage-attention`, `--use-ck-attention`", "EasyCache, TeaCache, MagCache",
                  "TorchCompileModel", "Quantised and GGUF checkpoints", "LoRAs and distilled few-step models",
                  "KJNodes low-VRAM nodes"):
        assert section(title).strip(), title
    assert "not tested" in section("Quantised and GGUF checkpoints").lower()
    install = section("Install into ComfyUI")
    assert "ComfyUI 0.30.0 or later" in install
    assert r"python_embeded\python.exe" in install
    assert "https://huggingface.co/Comfy-Org/MiniMax-H3/resolve/main/" in section("Bundled workflows and model files")
    trouble = section("Troubleshooting")
    for case in ("Out of memory", "Triton is missing or fails to compile", "The output looks worse",
                 "Bypass the node", "Conflicts with other attention patches"):
        assert f"**{case}" in trouble, case


def test_minimum_comfyui_matches_the_registry_metadata():
    import tomllib

    meta = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["comfy"]
    assert meta["requires-comfyui"] == ">=0.30.0"
    assert "ComfyUI 0.30.0 or later" in README
