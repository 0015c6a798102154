"""A reward the tiny model can learn in a few steps, for the fast quickstart test (`module:function`)."""


def starts_with_seven(trajectory, text: str) -> float:
    return float(text.startswith("7"))
