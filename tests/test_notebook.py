"""The notebook as a reader meets it: its shape, its reading order, and its saved outputs."""

import ast
import builtins
import json
import re
import statistics
import symtable

from notebook_source import (
    NOTEBOOK,
    README,
    REPO,
    code_sha256,
    markdown_cell,
    notebook_cells,
    outputs_text,
    source,
    stated_run_seconds,
)

PARAMETERS = (
    "PRECISION SEED VOCAB_SIZE MAX_STRIDE SEQ_LEN D_MODEL N_LAYERS N_HEADS FFN_HIDDEN BATCH_SIZE "
    "TRAIN_STEPS LEARNING_RATE FP8_FORMAT AMAX_HISTORY_LEN AMAX_COMPUTE_ALGO FP8_MARGIN "
    "EVAL_PROMPTS PROMPT_LEN GEN_TOKENS RESULTS_JSON TE_WHEEL_DIR"
).split()
# The cells that teach: never collapsed (found by what they define or do)
LESSON = (
    "class CausalLM(",
    "def train_step(",
    "def update_scales(",
    "update_scales(history, scale",
)
LESSON += ("def fp8_tensors(", "def check_scale_update(", "def generate_greedy(")
LESSON += ("scores = stride_scores(prompts, continuations",)  # section 9's check


def code_lines(cell):
    return [line for line in source(cell).splitlines() if line.strip()]


def code_cells(cells=None):
    return [c for c in cells or notebook_cells() if c["cell_type"] == "code"]


def python_cells():
    """The code cells that run in the notebook's namespace (not a `%%writefile` cell's file)."""
    return [c for c in code_cells() if not source(c).startswith("%%writefile ")]


def collapsed(cell):
    metadata = cell["metadata"]
    return metadata.get("cellView") == "form" or metadata.get("jupyter", {}).get("source_hidden")


def heading_at(cells, prefix, start=0):
    """The index of the first cell from start on whose source starts with prefix."""
    return next(i for i, c in enumerate(cells) if i >= start and source(c).startswith(prefix))


def core():
    """The cells before section 10 ("Going further"): what a first reading covers."""
    cells = notebook_cells()
    return cells[: heading_at(cells, "## 10. Going further")]


def visible_lines(cells):
    return [line for c in code_cells(cells) if not collapsed(c) for line in code_lines(c)]


def reading_minutes(cells, view="colab"):
    """Words at 200 a minute, plus code lines at 6 a minute: in Colab the code a reader sees
    (collapsed cells show their title), on GitHub every line (it shows collapsed code)."""
    words = sum(len(re.findall(r"\w+", source(c))) for c in cells if c["cell_type"] == "markdown")
    every_line = [line for c in code_cells(cells) for line in code_lines(c)]
    lines = visible_lines(cells) if view == "colab" else every_line
    return words / 200 + len(lines) / 6


def going_further():
    cells = notebook_cells()
    return cells[len(core()) :]


def subsections(cells):
    """{heading: its cells} for every "### 10.x" of Going further, its introduction and 11."""
    parts, heading = {}, None
    for cell in cells:
        if cell["cell_type"] == "markdown" and re.match(r"#{2,3} ", source(cell)):
            heading = source(cell).splitlines()[0]
        parts.setdefault(heading, []).append(cell)
    return parts


def section_code_lines(heading):
    cells, inside, lines = notebook_cells(), False, 0
    for cell in cells:
        if cell["cell_type"] == "markdown" and source(cell).startswith("#"):
            inside = source(cell).startswith(heading)
        lines += len(code_lines(cell)) if inside and cell["cell_type"] == "code" else 0
    return lines


def test_one_parameters_cell_defines_exactly_the_documented_names():
    cells = notebook_cells("parameters")
    assert len(cells) == 1
    tree = ast.parse(source(cells[0]))
    assigned = [t.id for node in tree.body if isinstance(node, ast.Assign) for t in node.targets]
    assert assigned == PARAMETERS


def global_reads(text):
    """Names a cell's code reads from outside itself: module-level reads, and functions' globals."""
    reads, tables = set(), [symtable.symtable(text, "cell", "exec")]
    while tables:
        table = tables.pop()
        tables += table.get_children()
        for symbol in table.get_symbols():
            outside = (
                symbol.is_global() if table.get_type() != "module" else not symbol.is_assigned()
            )
            reads |= {symbol.get_name()} if symbol.is_referenced() and outside else set()
    return reads


def module_names(text):
    """The names a cell binds at module level (assignments, imports, functions, classes)."""
    table = symtable.symtable(text, "cell", "exec")
    return {s.get_name() for s in table.get_symbols() if s.is_assigned() or s.is_imported()}


def test_definition_cells_read_nothing_the_narrative_cells_define():
    """Definitions take their inputs as arguments (a Config, a plan), so that tests and users can
    call them with any values; only the notebook's narrative cells read the parameters."""
    narrative = set(PARAMETERS)
    for cell in python_cells():
        if "defs" not in cell["metadata"].get("tags", []):
            narrative |= module_names(source(cell))
    for cell in notebook_cells("defs"):
        assert not global_reads(source(cell)) & narrative, source(cell)[:200]


def test_no_cell_uses_a_name_the_reader_has_not_met():
    """Read top to bottom, every name a cell uses (in its functions too) is defined above it."""
    met = set(dir(builtins)) | {"display"}  # IPython's
    for cell in python_cells():
        text = source(cell)
        unmet = global_reads(text) - module_names(text) - met
        assert not unmet, f"{sorted(unmet)} used before they are defined, in:\n{text[:300]}"
        met |= module_names(text)


def test_no_cell_is_empty():
    assert all(source(cell).strip() for cell in notebook_cells())


def test_every_heading_opens_its_cell_and_subsections_count_from_1():
    numbers = []
    for cell in notebook_cells():
        if cell["cell_type"] != "markdown":
            continue
        headings = [line for line in source(cell).splitlines() if line.startswith("#")]
        assert all(source(cell).startswith(h) for h in headings[:1]) and len(headings) <= 1
        numbers += re.findall(r"^#{2,3} (\d+)\.(\d*)", source(cell))
    for (section, sub), (previous_section, previous_sub) in zip(numbers[1:], numbers, strict=False):
        if sub:  # a subsection follows its section or the subsection before it
            expected = (
                1 if not previous_sub or previous_section != section else int(previous_sub) + 1
            )
            assert (section, int(sub)) == (section, expected), (section, sub)


def test_no_code_cell_is_longer_than_40_lines():
    sizes = [len(code_lines(c)) for c in code_cells()]
    assert max(sizes) <= 40 and statistics.median(sizes) <= 20


def test_the_whole_notebook_does_not_grow():
    """Issue 21 asked for 1,250 code lines; the fixes of issue 20 and the features kept put it
    higher (the closing note of issue 21 says where the lines are). Issue 27 asked for 1,450 and
    cut 10.8, 10.9, 10.5 (its composed block, then its TE-against-reference check, which repeated
    section 8.2's), 10.1's code, lines ruff had split, one-use temporaries and helpers, to 1,450.
    Issue 31 asked again for 1,250: a compact table of parameter rules, and the repetitions found
    in the planner, 8.1's plot and 10.2 and 10.8, gave 1,437, the cap; the rest is code every
    rule, message, runtime and experiment needs (its closing note says where). Issue 44 asked for
    at most 1,460 with its fixes (cells that paste on their own, every rule at once, short runs
    that say so, the CPU's thread count measured, readable output): 1,460, once 10.2's per-step
    curve of the loss gap went (the gap of the means, printed, is what it measured; one step's
    loss is noise). Issue 46 allows 55 lines more (1,515) for checkpoints that carry the FP8
    state: 1,483 after its first step (the stand-in's `_extra_state`, in TE's format), 1,537
    after its third (10.7: the cell to copy, the bitwise check, the resume without the state);
    1,524 once one-use helpers went inline (the FP8 shape rule, 8.1's range used) and one-use
    temporaries went (10.4, 10.8, 10.10, the summary); 1,515, its target, once 10.7's experiment
    built, loaded and trained in one helper and a few constants went to default arguments. Issue
    47 allows 30 more (1,545) for the LM head out of FP8 and its measurement over seeds (10.2).
    Issue 48 allows 60 more (1,604) for TE's precision debug tools, the reference's statistics
    under TE's names, and the layer-by-layer search (10.11); its steps 1 to 4 stood at 1,677
    after 46 lines of savings elsewhere; 1,641 once 39 more were cut (docstrings as comments,
    one-use helpers folded, 10.11's tightened) and 10.9 ran both settings in one launch (+3);
    1,628 with te_debug closing nvdlfw_inspect's log handlers and the layer search's guard (+6),
    and 19 more cut (10.8's and 10.11's helpers folded into their collapsed cells, `using` by
    mock.patch); 1,633 with the reference's CPU speed-ups (+5: statistics only where a tracker
    reads them, FP8 operands upcast once), Run all 18% faster; 1,604, the target, once 30 more
    went (docstrings as def-line comments, the planner's reasons named, one-use temporaries).
    Issue 57 allows 20 more (1,624) for what TE's source showed on an FP8 GPU: fp8_tensors
    keeps TE's GEMM modules only (+4), the nested autocast's recipe (+3), 10.7's deterministic
    attention (+3), 10.11's full-precision log and the harness's SystemExit (+10). Issue 58
    allows 25 more (1,649) for what a new user hit: FP8 decoding pads rows, not the length (+0);
    fp8_lesson.py gets cfg (+2); 10.7's checkpoint keeps the scheduler and the batch generator,
    and its check runs section 7's schedule and saves after an evaluation too (+12); 10.11's
    layer search calls a change measurable at 1% of the loss, and gives shares only of such a gap
    (+6). Issue 59 allowed 60 more (1,709) for evaluating, generating and serving after training
    (10.12); its four steps took 124 (10.12's cells 118: fp8_state_kept and its check on copies
    of the model as 8.2 left it, 48; generation both ways, 14; the serving file and the weights
    cast at scale 1, 37; the estimate per generated token, 19; the stand-in's is_first_microbatch,
    5; 8.2's state kept for 10.12, 1), and 13 were cut elsewhere (walruses, two cell merges, a
    loop as a helper): 1,755, 46 over its target. Its GPU parts took 50 more: the stripped file
    loaded into TE's FP8 weights built under no_grad, their casts and memory (18, and its skip and
    run, 2); time per generated token for the three ways (19, its run 1); 10.6's build as a helper
    both use (+3), one timing loop for the benchmark and generation (+6), the flush count and SQNR
    in one place (+2); 1 cut (10.12's check reuses 8.2's batch): 1,805, 96 over its target.
    Issue 60 allows 25 more (1,830) for one precision plan everywhere and a probe that tells FP8
    from a broken runtime: 10.2's BF16 run beside an FP8 section 7 (+1, reading section 8's
    runs), fp8_ddp.py told the plan's recipe (+4: the flag, the state check without
    DelayedScaling's state, the launch's flag and label); the probe's finite check and its BF16
    step, which sets TE_ERROR (+6); 10.8's probes in a process of their own, with cells_of
    shared with fp8_lesson.py (+12); 10.10's round timed by two CUDA events (+1), 10.8's
    block-scaling cast compared (+0), 10.7's header (+1): 1,830. Issue 61 allowed 8 more (1,838)
    for TE's pickle gate opened per load and checkpoints read onto the CPU: the stand-in's
    loader asks for the variable, as TE's does (+2); load_weights (our own state dicts) opens it
    for its load (+1); load_checkpoint opens it for its load (+1, its `import os` gone: mock
    patches "os.environ" by name) and may leave the batches' generator out (+1), its process-
    wide setting gone (-1): 1,834. Issue 62 allows 40 more (1,874) for small models on a GPU:
    10.10's launch floor (the counts +3, the host's launch time +4, each precision's step at
    least its launches +5, the plot's launch-bound sizes circled +3, the table's header moved
    beside its row +2, the cost measured and shown +3, a title line +2): 1,856 after step 1. Its
    CUDA graphs: the copy cell's graphed() (+9), step_ms's capture and profiled step and the
    findings' graphed-against-eager lines (+9), the benchmark's graphed runs, kernel counts and
    FP8 scales beside the eager ones' (+8): 1,882; cut back to 1,874 by one-use helpers and
    temporaries inlined (10.7's deterministic_attention, 10.12's prints and loop filter), a
    duplicate import, and a comment the printed header repeats. After review: the launches a
    step made (not its kernels, which a graph replays too), an eager run's scales beside another's,
    a failed capture undone (+4; LAUNCHES' comment, the copy cell's call and docstring, step_ms's
    docstring and a temporary, -5): 1,873; the FP8 states kept per size, not popped (+1): 1,874."""
    assert sum(len(code_lines(c)) for c in code_cells()) <= 1874


def test_the_lesson_reads_in_45_minutes_in_colab_and_meets_fp8_early():
    """Issue 21's targets for sections 1 to 9: 45 minutes of careful reading in Colab's view,
    and a GitHub reader, who sees every line, reaches the first FP8 cast within 180 code lines;
    te.TransformerLayer comes within the first 150 visible lines."""
    assert reading_minutes(core()) <= 45
    cast = re.compile(r"\.to\(FP8_DTYPES|float8_e4m3fn\)|quantize\(")
    every_line = [line for c in code_cells(core()) for line in code_lines(c)]
    first_cast = next(
        i for i, line in enumerate(every_line) if cast.search(line) and "def " not in line
    )
    assert first_cast <= 180
    visible = visible_lines(core())
    assert next(i for i, line in enumerate(visible, 1) if "te.TransformerLayer(" in line) <= 150


def test_the_lesson_on_github_does_not_grow():
    """Issues 21 and 31 asked for 100 minutes on GitHub; the install, the planner and the
    stand-in, all collapsed in Colab, keep it above that (see their closing notes): 152.5 minutes
    after issue 31; 157.9 after issue 44 (cells to copy that open with their imports and print
    the FP8 state, every broken rule at once, the CPU's BF16 fact and thread count, short runs
    that say so); 161.9 after issue 46 (the stand-in saves and loads its FP8 state in a state
    dict's `_extra_state`, as TE's modules do). It must not grow."""
    assert reading_minutes(core(), "github") <= 161.95


def test_going_further_reads_in_70_minutes_in_colab_none_of_it_over_12():
    """60.8 after issue 48 folded 10.8's and 10.11's machinery into collapsed cells: 61, no more;
    issue 59 adds 10.12, at most 8 minutes: 69; issue 60's lines (one plan everywhere): 70."""
    assert reading_minutes(going_further()) <= 70
    for heading, cells in subsections(going_further()).items():
        assert reading_minutes(cells) <= 12, heading


def test_10_11_reads_in_7_minutes_in_colab():
    """Issue 48's target for TE's debug tools and the layer-by-layer search."""
    parts = {heading.split()[1]: cells for heading, cells in subsections(going_further()).items()}
    assert reading_minutes(parts["10.11"]) <= 7


def test_10_12_reads_in_8_minutes_in_colab():
    """Issue 59's target for evaluating, generating and serving after training."""
    parts = {heading.split()[1]: cells for heading, cells in subsections(going_further()).items()}
    assert reading_minutes(parts["10.12"]) <= 8


def test_issue_27s_sections_keep_their_reading_times():
    """10.6 at most 9.5 minutes in Colab; 10.8 and 10.9 at most 12 (above); 10.9 on GitHub was 32
    minutes, its target 16: met, with the script in one cell and its launcher collapsed; 16.4
    after issue 44's handling of a batch the ranks do not divide (refused by the script, the
    two-rank check skipped for an odd batch); issue 60 told the script the plan's recipe and
    moved its launcher's helpers to 10.8's process cell: 15.6."""
    parts = {heading.split()[1]: cells for heading, cells in subsections(going_further()).items()}
    assert reading_minutes(parts["10.6"]) <= 9.5
    assert reading_minutes(parts["10.9"], "github") <= 16.4
    (script,) = [c for c in code_cells() if source(c).startswith("%%writefile fp8_ddp.py\n")]
    assert not collapsed(script) and "DistributedDataParallel(" in source(script)


def test_no_sentence_sends_a_colab_reader_to_a_file_it_does_not_have():
    prose = " ".join(source(c) for c in notebook_cells() if c["cell_type"] == "markdown")
    outputs = " ".join(outputs_text(saved()["cells"]))
    for text in (prose, outputs):
        assert not re.search(r"tests/|README|\.ci/", text)


def test_machinery_is_collapsed_the_colab_way_and_the_lesson_never_is():
    for cell in code_cells():
        metadata, text = cell["metadata"], source(cell)
        if collapsed(cell):  # Colab's form view and Jupyter's hidden source, with a title
            assert metadata.get("cellView") == "form" and metadata["jupyter"]["source_hidden"]
            assert text.startswith("# @title "), text[:80]
            assert not any(piece in text for piece in LESSON), text[:80]
        else:
            assert "@title" not in text
    shown = "".join(source(c) for c in code_cells() if not collapsed(c))
    assert all(piece in shown for piece in LESSON)


def test_one_short_cell_holds_a_literal_copyable_training_step():
    steps = [c for c in code_cells() if "def train_step(" in source(c)]
    assert len(steps) == 1
    text, lines = source(steps[0]), code_lines(steps[0])
    assert len(lines) <= 15 and "scaler" not in text  # the FP16 variant comes after, on its own
    order = ["with torch.autocast(", "with te.autocast(enabled=", "recipe=recipe)", "model(inputs)"]
    order += ["loss.backward()", "clip_grad_norm_(", "optimizer.step()"]
    positions = [text.index(fragment) for fragment in order]
    assert positions == sorted(positions)


def test_the_te_model_reads_on_its_own_in_one_short_cell():
    (cell,) = [c for c in code_cells() if "class CausalLM(" in source(c)]
    text = source(cell)
    assert len(code_lines(cell)) <= 40
    for piece in ("nn.Embedding(", "te.TransformerLayer(", "te.LayerNorm(", "te.Linear("):
        assert piece in text
    assert 'attn_input_format="bshd"' in text and 'self_attn_mask_type="causal"' in text


def test_at_most_six_figures_before_going_further():
    shows = sum(source(c).count("plt.show()") for c in code_cells(core()))
    assert 1 <= shows <= 6


def test_the_scale_is_drawn_where_it_is_taught_sections_2_and_8_each_show_a_figure():
    """Section 2 draws one tensor against E4M3's range, as it is and scaled; section 8 draws the
    scales of the run, per role, orders of magnitude apart (issue 30): in the saved run too."""
    cells = saved()["cells"]
    for heading in ("## 2. ", "## 8. "):
        start = heading_at(cells, heading)
        end = heading_at(cells, "## ", start + 1)
        outputs = [o for c in code_cells(cells[start:end]) for o in c["outputs"]]
        assert any("image/png" in o.get("data", {}) for o in outputs), heading


def test_every_loss_printed_in_sections_7_to_9_and_the_summary_says_which_loss_it_is():
    """One step's loss, or a mean of the last N: a bare "loss 0.13" reads as either."""
    cells = saved()["cells"]
    start, further, summary = (heading_at(cells, f"## {n}. ") for n in (7, 10, 11))
    shown = outputs_text(cells[start:further] + cells[summary:])
    lines = [line for text in shown for line in text.splitlines()]
    said = ("this step's loss", "at step 1", "mean of the last")
    losses = [line for line in lines if "loss" in line.lower()]
    assert len(losses) >= 7 and all(any(s in line for s in said) for line in losses), losses
    changes = [line for line in losses if "->" in line]
    assert len(changes) >= 3, losses
    assert all("at step 1" in line and "mean of the last" in line for line in changes), changes


def test_figure_titles_are_computed_from_the_run_or_say_what_is_plotted():
    """A title that states a conclusion must be computed from the data; a fixed one names what
    the figure shows. Every figure title is an f-string, so it can carry this run's numbers."""
    titles = []
    for cell in python_cells():
        for node in ast.walk(ast.parse(source(cell))):
            if isinstance(node, ast.Call) and ast.unparse(node.func).endswith(
                ("title", ".set_title")
            ):
                titles.append(node.args[0])
    assert titles and all(isinstance(t, ast.JoinedStr) for t in titles)
    assert all(any(isinstance(v, ast.FormattedValue) for v in t.values) for t in titles)


def test_the_benchmark_section_stays_short():
    """An estimate for every FP8 GPU Colab offers, and a timing of every recipe on a GPU; with
    the estimate part by part (issue 45), at most 9 minutes in Colab's view; issue 62 (the launch
    floor, CUDA graphs): 10."""
    assert 0 < section_code_lines("### 10.10") <= 160
    parts = {heading.split()[1]: cells for heading, cells in subsections(going_further()).items()}
    assert reading_minutes(parts["10.10"]) <= 10


def test_the_checkpoint_section_reads_in_6_minutes():
    """Issue 46's target for 10.7 (save and resume with the FP8 state), in Colab's view."""
    parts = {heading.split()[1]: cells for heading, cells in subsections(going_further()).items()}
    assert reading_minutes(parts["10.7"]) <= 6


def test_ci_runs_the_readme_test_command():
    readme = README.read_text()
    commands = re.findall(r"```bash\n(.*?)```", readme, re.DOTALL)
    assert len(commands) == 2  # one runs the notebook, one runs the tests
    test_command = next(c.strip() for c in commands if "pytest" in c)
    assert test_command in (REPO / ".ci" / "run").read_text()


def test_the_readme_says_what_a_newcomer_needs_in_170_lines():
    """Issue 58: no history, what the commands download and PyTorch's CPU build instead, the one
    skipped test, and the files a run leaves (the keys of RESULTS_JSON: test_headless_runs)."""
    readme = README.read_text()
    assert len(readme.splitlines()) <= 170
    assert not re.search(r"(went|added|became|until) [^.]*\b20\d\d\b", readme)  # no history
    assert "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu" in readme
    assert "**The one skipped test** is `tests/te_stage/`" in readme
    for name in ("fp8_checkpoint.pt", "fp8_lesson.py", "fp8_ddp.py"):
        assert f"`{name}`" in readme.split("**Files a run leaves**")[1].split("\n\n")[0]


def test_the_prose_states_the_flush_thresholds_the_notebook_computes(nb):
    """Section 4 and 10.3 say how far below its maximum each format flushes; fp8_layout says it."""
    prose = " ".join(source(c) for c in notebook_cells() if c["cell_type"] == "markdown")
    for fmt in ("E4M3", "E5M2"):
        assert f"2^{nb.fp8_layout(fmt)['span']:.1f}" in prose
    assert "2^17.8" not in prose and "2^31.8" not in prose


# The saved outputs: from one top-to-bottom CPU run of exactly this code (tests/save_outputs.py)
def saved():
    return json.loads(NOTEBOOK.read_text())


def test_the_saved_outputs_are_from_a_run_of_this_code():
    nb = saved()
    recorded = nb["metadata"]["te_fp8_training"]["outputs_of_code_sha256"]
    assert recorded == code_sha256(nb["cells"]), "stale outputs: run tests/save_outputs.py"
    code = code_cells(nb["cells"])
    assert [c["execution_count"] for c in code] == list(range(1, len(code) + 1))  # top to bottom
    assert not any(o["output_type"] == "error" for c in code for o in c["outputs"])
    assert not any(o.get("name") == "stderr" for c in code for o in c["outputs"])
    assert sum("image/png" in o.get("data", {}) for c in code for o in c["outputs"]) >= 5


def test_the_saved_outputs_are_the_cpu_plan_and_say_so():
    nb = saved()
    text = "\n".join(outputs_text(nb["cells"]))
    assert "Plan: FP32" in text and "CPU (" in text
    assert "saved outputs" in source(nb["cells"][0]) and "2-core CPU" in source(nb["cells"][0])


def test_the_saved_outputs_hold_no_path_of_the_machine_that_ran_them():
    for text in outputs_text(saved()["cells"]):
        assert not re.search(r"/(work|tmp|root|home|usr|opt)/|site-packages|\\Users\\", text), text


def test_the_notebook_file_stays_small():
    assert NOTEBOOK.stat().st_size <= 1.5 * 2**20


def test_the_first_thing_the_notebook_prints_is_not_an_error():
    first = next(text for text in outputs_text(saved()["cells"]) if text.strip())
    assert not re.search(r"Error|Invalid|Traceback|FAILED", first), first


def test_10_2s_choice_quotes_the_saved_runs_own_numbers():
    assert_10_2s_reading_holds(saved()["cells"])


def assert_10_2s_reading_holds(cells):
    """Issues 47 and 58: the markdown after the head's measurement quotes its means, rounded
    ("about"), and its verdicts: those of the run in `cells` (the saved one; in the headless
    tests, runs at one and two threads, which must not contradict it)."""
    printed, text = printed_before(cells, "The choice, from the saved")
    means = {  # per setting: loss, logits SQNR, head's dW SQNR
        name: [float(x) for x in re.findall(r"(\d+\.\d+) \[", line)]
        for line in printed.splitlines()
        for name in ("FP8 everywhere", "FP8 but the head")
        if re.match(f"{name} +\\d", line)
    }
    (every, head) = means.values()
    loss = re.search(r"about ([\d.]+) with FP8 everywhere and with the head out", text)
    pattern = (
        r"nearer FP32, about (\d+) dB against (\d+), and the logits too, about (\d+) against (\d+)"
    )
    quoted = [float(loss[1])] * 2 + [float(x) for x in re.search(pattern, text).groups()]
    measured = every[0], head[0], head[2], every[2], head[1], every[1]
    near = [0.05] * 2 + [0.75] * 4  # "about": the quoted rounding, with room for another CPU
    assert all(abs(q - x) < d for q, x, d in zip(quoted, measured, near, strict=True)), quoted
    (verdict,) = [line for line in printed.splitlines() if line.startswith("The head out of FP8")]
    assert verdict.count("inside the spread") == 1 and "(inside the spread);" in verdict  # loss
    assert "differs inside the spread" in text and "both outside the spread" in text


def test_the_stated_run_time_is_the_saved_runs_own():
    nb = saved()
    (took,) = [
        m for t in outputs_text(nb["cells"]) for m in re.findall(r"Run all took\s+(\d+) s", t)
    ]
    assert stated_run_seconds(source(nb["cells"][0])) == int(took)
    assert stated_run_seconds(README.read_text()) == int(took)
    # a CPU Run all in at most 50 s (issue 48's target). Issue 47's head out of FP8 (3 seeds, 2
    # settings) cost 6-12 s; 10.11 costs 2.8 s. Then the reference's statistics only where read
    # and its FP8 operands upcast once (interleaved runs 71 and 68 s before, 57 and 57 after);
    # then 10.2's and 10.3's runs at 20 steps, not 30 (papermill on a quiet machine: 45 s before,
    # 40 after; the save 42 s). Saves of the same code vary by up to 25% with the machine's load,
    # and by machine: issue 57's (a 2-core AMD EPYC, AVX2 only; FP32 training 4.6 s, not 3.3)
    # saved issue 48's final code in 57 s and its own in 53 s, quiet. So 60 s, on either machine.
    # Issue 58's target, 50 s: its saves took 36 to 46 s on an Intel Xeon (AVX-512, 2 threads).
    # Issue 59's 10.12 (three experiments, each a generation or two): on a 2-core AMD EPYC,
    # interleaved saves took 49 and 50 s before it, 57 and 59 s after. So 60 s, on either machine.
    assert int(took) <= 60


def test_the_first_screen_says_what_colab_collapses_and_where_the_lesson_starts():
    """A GitHub reader sees every cell's code: the first cell says which cells Colab collapses
    (those that open with `# @title`: the test of machinery above holds it to that) and names the
    section where the lesson starts, by its heading."""
    first = " ".join(source(notebook_cells()[0]).split())
    assert "skip the cells that open with `# @title`: Colab collapses them" in first
    ((number, title),) = re.findall(r'The lesson starts at section (\d+), "([^"]+)"', first)
    headings = [source(c).splitlines()[0] for c in notebook_cells() if c["cell_type"] == "markdown"]
    assert f"## {number}. {title}" in headings


def test_section_8_says_fp8_meta_is_tes_internal_state_and_points_to_its_debug_tools():
    text = " ".join(markdown_cell("## 8. Inside FP8 training").split())
    assert "TE's internal state, not an API" in text and "TE's debug tools (10.11)" in text


FLUSHED = ("underflows%", "fp8_current_scaling_underflows%")


def printed_before(cells, markdown_start):
    """What the code cell just above the markdown cell that starts so printed, and that cell."""
    (index,) = [i for i, c in enumerate(cells) if source(c).startswith(markdown_start)]
    return " ".join(outputs_text(cells[index - 1 : index])), " ".join(source(cells[index]).split())


def test_10_11s_readings_are_the_saved_runs_own():
    assert_10_11s_readings_hold(saved()["cells"])


def assert_10_11s_readings_hold(cells):
    """Issues 48 and 58: the markdown after each of 10.11's experiments says what the run in
    `cells` printed: the saved run's, and (the headless tests) a run's at one and two threads.
    The layer search gives no shares of a gap that is not measurable (at TRAIN_STEPS=5 it printed
    shares of 204% and -151%; its per-layer shares moved with the CPU and the thread count)."""
    printed, text = printed_before(cells, "From the saved CPU run: step 1 casts")
    rows = {line.split()[0]: line.split()[1:] for line in printed.splitlines() if "%" in line[:32]}
    under, current = ([float(v) for v in rows[s]] for s in FLUSHED)
    assert f"flushes {rows['underflows%'][4]}% of the gradients' values" in text  # gradient, step 1
    assert all(d <= 1.5 * c for d, c in zip(under[1::2], current[1::2], strict=True))  # later
    printed, text = printed_before(cells, "From the saved CPU run (")
    (whole,) = re.findall(r"No layer in FP8: the loss moves ([+-]\d+\.\d+)%; none hurts", printed)
    assert abs(float(whole)) < 1 and "moves the loss by under 1%, not measurably" in text
    layers = [line for line in printed.splitlines() if re.match(r"layers\.\d+ out", line)]
    assert len(layers) >= 2 and all(line.endswith("(not measurable)") for line in layers)
    assert "of the gap" not in printed and "has no layer that costs 1% of the loss" in text


def test_10_12s_readings_are_the_saved_runs_own():
    assert_10_12s_readings_hold(saved()["cells"])


def assert_10_12s_readings_hold(cells):
    """Issue 59: the markdown after 10.12's check says what the run in `cells` printed."""
    printed, text = printed_before(cells, "From the saved CPU run, and at one thread: inside")
    found = dict(re.findall(r"^ *([\w: ]+): (\S+)$", printed.replace(" \n", "\n"), re.MULTILINE))
    (n,) = re.findall(r"Of (\d+) forward FP8 tensors", printed)
    assert found["without it: scales unchanged"] == "True" and "changed no scale" in text
    assert found["row 0 holding its amaxes"] == n and "row 0 of every forward" in text
    assert int(found["next step scales that differ"]) <= int(found["above the window max"])
    differ, change = (
        int(found["next step scales that differ"]),
        float(found["their largest change pct"]),
    )
    assert (differ > 0) == (change > 0) and "by up to the share printed" in text
    assert found["fp8_state_kept: state bitwise"] == "True" and "left the FP8 state bitwise" in text
    assert found["eval then gradients rolled"] == n and "rolled every history" in text
    printed, text = printed_before(cells, "From the saved CPU run, and at one thread: with FP8")
    rows = re.findall(
        r"(\w+) *: the right stride on (\S+)% of continuations, (\S+)% of tokens; "
        r"(\S+)% as FP8's",
        printed,
    )
    assert [name for name, *_ in rows] == ["FP8", "FP32"]  # a CPU: FP32 is its high precision
    assert all(v == "100.0" for _, *values in rows for v in values), rows
    assert "right stride, and the two agree on every token" in text
    assert "cast at every step: the same tokens as cast once: True" in printed
    assert "gave the same tokens as cast at every step" in text
    printed, text = printed_before(cells, "From the saved CPU run, and at one thread: the weights")
    (alone, checkpoint) = re.findall(r"(\d+\.\d+) MB", printed)
    rows = re.findall(
        r"Cast at (.+?): ([\d,]+) of ([\d,]+) weights flushed; SQNR: weights (\S+) dB, logits "
        r"\S+ dB; right: (\S+)% of continuations, (\S+)% of tokens",
        printed,
    )
    assert 0.25 < float(alone) / float(checkpoint) < 0.4 and "a third of the checkpoint" in text
    (_, trained, total, trained_db, *right), (one, at_one, _, one_db, *right_too) = [
        [v.replace(",", "") for v in row] for row in rows
    ]
    assert one == "scale 1" and int(trained) < int(at_one) / 100 and "against a handful" in text
    assert 0.01 < int(at_one) / int(total) < 0.1 and "a few percent" in text
    assert 0 <= float(trained_db) - float(one_db) < 1 and "drops by under 1 dB" in text
    assert right + right_too == ["100.0"] * 4 and "the stride stays right" in text
    printed, text = printed_before(cells, "By this estimate every batch here is bandwidth-bound")
    rows = {
        " ".join(r.split()[:-3]): r.split()[-3:] for r in printed.splitlines() if " batch " in r
    }
    assert len(rows) == 9 and "FP8 weights halve BF16's, casting BF16 weights at every" in text
    for bf16, casts, fp8 in ([float(v) for v in values] for values in rows.values()):
        assert abs(casts / bf16 - 2) < 0.01 and abs(fp8 / bf16 - 0.5) < 0.01
    # by hand: 12 layers of QKV (2048 x 6144), proj (2048 x 2048), fc1 and fc2 (2048 x 8192
    # each), the head 2048 x 100, at 2 bytes each, read at the L4's 300 GB/s, in µs
    weights = 12 * (2048 * 6144 + 2048 * 2048 + 2 * 2048 * 8192) + 2048 * 100
    assert rows["L4 batch 1"][0] == f"{2 * weights / 300e9 * 1e6:.3g}"
