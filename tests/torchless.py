"""Python source that makes torch unimportable in the process that runs it first: a
``sys.meta_path`` finder that refuses ``torch`` and its submodules and records every attempt
(``BLOCKED``), so a test can prove a code path never even tries to import it."""

BLOCK_TORCH = '''
import sys

BLOCKED = []


class _NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            BLOCKED.append(name)
            sys.stderr.write(f"torchless: import of {name} refused\\n")
            raise ImportError(f"torch is unimportable in this process ({name})")
        return None


sys.meta_path.insert(0, _NoTorch())
'''
