"""One-off experiments: same-run A/Bs and stress loops behind a decision in docs/ or BENCHMARKS.md.

The standing benchmarks are one level up; these are kept so that the decisions they informed
can be re-measured.
"""
