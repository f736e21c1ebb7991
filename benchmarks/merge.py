"""Merge the JSON files of several benchmarks/run.py invocations of one GPU run into one
markdown table (ratios against FLA rows of the same run): `python merge.py a.json b.json`."""
import json
import sys

from run import print_table

rows = []
for path in sys.argv[1:]:
    with open(path) as f:
        data = json.load(f)
    if not rows:
        print("env:", json.dumps(data["env"]))
    rows += data["rows"]
print_table(rows)
