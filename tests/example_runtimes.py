"""Each runtime's facts as section 4's Hardware holds them (the A100's in TE's own words).
Section 10.1's first table is choose_plan on these (test_plan.py); the TE stage checks the facts,
and 10.1's table of TE's other recipes, against TE's own checks on each compute capability."""

TE_SAYS_BELOW_89 = "Device compute capability 8.9 or higher required for FP8 execution."
RUNTIMES_HEADER = (
    "| runtime | compute capability | precision | modules | TE's default recipe | why not FP8 |"
)
RECIPES_HEADER = "| TE's other recipe | L4 | H100 / H200 | G4 (RTX PRO 6000) |"


def tes_check(cell):
    """What TE's check says in a recipe-table cell; after a comma: what only a run decides."""
    return cell.split(",")[0]


def example_runtimes(nb):
    hw = nb.Hardware
    return {
        "CPU": hw("CPU"),
        "T4": hw("Tesla T4", (7, 5), "TE supports compute capability 8.0+"),
        "A100": hw("A100", (8, 0), None, TE_SAYS_BELOW_89),
        "L4": hw("L4", (8, 9), None, None, "DelayedScaling"),
        "H100 / H200": hw("H100", (9, 0), None, None, "DelayedScaling"),
        "G4 (RTX PRO 6000)": hw("RTX PRO 6000", (12, 0), None, None, "Float8CurrentScaling"),
    }


def plan_rows(nb):
    """(runtime, compute capability, precision, modules, TE's default recipe where FP8 runs,
    why not FP8) of choose_plan on each."""
    for runtime, hw in example_runtimes(nb).items():
        plan = nb.choose_plan(hw)
        cc = "{}.{}".format(*hw.capability) if hw.capability else "—"
        modules = "TE" if plan.backend == "te" else "PyTorch"
        default = hw.te_default_recipe if plan.precision == "fp8" else "—"
        yield runtime, cc, plan.precision.upper(), modules, default, plan.fallbacks.get("FP8", "—")
