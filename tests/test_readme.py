"""The README: the set-up block CI reads, the BENCHMARKS.md sections it quotes, links that resolve in
the repository."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text(encoding="utf-8")


def test_setup_block_has_the_demo_and_the_test_command_each_in_its_own_venv():
    block = README.split("## Set-up commands", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    lines = [ln for ln in block.splitlines() if ln.strip()]
    comments = [i for i, ln in enumerate(lines) if ln.startswith("#")]
    assert [lines[i].split()[1] for i in comments] == ["main", "tests"]
    for i in comments:
        command = lines[i + 1]
        assert command.startswith("python3 -m venv ")
        assert " -m pip install " in command
    assert lines[comments[0] + 1].endswith("-m adaptive_sparse_attention demo")
    assert lines[comments[1] + 1].endswith("-m pytest tests")


def test_quoted_benchmark_sections_exist():
    headings = [re.sub(r"\s*\(issue \d+\)\s*$", "", h) for h in
                re.findall(r"^#+ (.+)$", (ROOT / "BENCHMARKS.md").read_text(encoding="utf-8"), re.M)]
    quoted = re.findall(r'BENCHMARKS\.md,? "([^"]+)"', re.sub(r"\s+", " ", README))
    assert quoted
    missing = [q for q in quoted if not any(h.startswith(q) for h in headings)]
    assert not missing, f"README quotes BENCHMARKS.md sections that do not exist: {missing}"


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
