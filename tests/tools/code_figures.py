"""Figures of the code for reviews (issue 22): the longest functions in plugins/ and the lines of
each module_utils file. Usage: python tests/tools/code_figures.py [checkout] [--top N]"""
import argparse
import ast
import os


def functions(root):
    """[(lines, path, name)] for every function and method under plugins/."""
    found = []
    for folder, _subdirs, files in os.walk(os.path.join(root, "plugins")):
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(folder, name)
            with open(path, encoding="utf-8") as handle:
                tree = ast.parse(handle.read())
            for node in ast.walk(tree):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    found.append((node.end_lineno - node.lineno + 1, os.path.relpath(path, root), node.name))
    return sorted(found, reverse=True)


def module_utils_lines(root):
    """[(lines, path below module_utils)] of plugins/module_utils/**/*.py (the wings' folders too)."""
    folder = os.path.join(root, "plugins", "module_utils")
    out = []
    for here, dirs, files in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in sorted(files):
            if name.endswith(".py"):
                path = os.path.join(here, name)
                with open(path, encoding="utf-8") as handle:
                    out.append((sum(1 for _line in handle), os.path.relpath(path, folder)))
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("root", nargs="?", default=".")
    parser.add_argument("--top", type=int, default=12)
    args = parser.parse_args()
    funcs = functions(args.root)
    print("longest functions:")
    for lines, path, name in funcs[:args.top]:
        print(f"  {lines:4d}  {path}:{name}")
    print(f"functions: {len(funcs)}, over 40 lines: {sum(1 for f in funcs if f[0] > 40)}, over 60: {sum(1 for f in funcs if f[0] > 60)}")
    print("module_utils lines:")
    sizes = module_utils_lines(args.root)
    for lines, name in sizes:
        print(f"  {lines:5d} {name}")
    print(f"  {sum(n for n, _name in sizes):5d} total")


if __name__ == "__main__":
    main()
