"""python -m runtime.accelerators: print which backend each op takes on this machine and why."""

from .explain import explain

if __name__ == "__main__":
    print(explain())
