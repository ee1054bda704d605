#!/bin/sh
# Prints the pip options that make torch's CPU build resolvable for the pip given as $1:
# nothing when that pip finds the pin of requirements/runtime.txt already (a local wheel or
# a mirror in pip's own configuration), else "-r requirements/torch-cpu-index.txt" (PyTorch's
# CPU index, named there only). The Makefile puts its output before every requirement file
# that pins torch's CPU build.
pip="$1"
dir=$(dirname "$0")/../requirements
pin=$(sed -n 's/^\(torch==[^;# ]*+cpu\).*/\1/p' "$dir/runtime.txt")
if [ -n "$pin" ] && "$pip" install --dry-run --no-deps --ignore-installed --quiet "$pin" \
        >/dev/null 2>&1; then
    exit 0
fi
echo "-r requirements/torch-cpu-index.txt"
