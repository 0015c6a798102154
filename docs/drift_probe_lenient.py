"""The lenient arithmetic verifier tidal had until 2026-11-28 (the first integer anywhere), for docs/drift_probe.py."""
import re
_INTEGER = re.compile(r"(-?)0*(\d+)")

def arithmetic(trajectory, text):
    found = _INTEGER.search(text)
    if found is None:
        return 0.0
    sign, digits = found.groups()
    return float(("" if digits == "0" else sign) + digits == str(int(trajectory.meta["answer"])))
