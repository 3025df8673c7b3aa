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
        assert command.startswith("python3 -m venv ") and " -m pip install " in command
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
    assert "../" not in README and not re.search(r"\bissues? \d+", README, re.I)
    for target in re.findall(r"\]\(([^)#]+)\)", README):
        if not target.startswith(("http://", "https://")):
            assert (ROOT / target).exists(), f"README links to {target}, which is not in the repository"
