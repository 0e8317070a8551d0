"""Python source that makes a library unimportable in the process that runs it first: a
``sys.meta_path`` finder that refuses the library and its submodules and records every attempt
(``BLOCKED``), so a test can prove a code path never even tries to import it (torch in the
control plane, triton on the CPU path)."""


def blocker(library: str) -> str:
    return f'''
import sys

BLOCKED = []


class _Refuse:
    def find_spec(self, name, path=None, target=None):
        if name == "{library}" or name.startswith("{library}."):
            BLOCKED.append(name)
            sys.stderr.write(f"torchless: import of {{name}} refused\\n")
            raise ImportError(f"{library} is unimportable in this process ({{name}})")
        return None


sys.meta_path.insert(0, _Refuse())
'''


BLOCK_TORCH = blocker("torch")
BLOCK_TRITON = blocker("triton")
