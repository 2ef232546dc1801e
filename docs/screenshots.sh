#!/bin/sh
# Writes the screenshots the README shows, 1,400 px wide, as headless
# Chromium (Debian package chromium) renders them in the tests that check
# the pages for script errors:
#
#   docs/slownode-report.png          the slow-node HTML report of a
#                                     generated 16-rank job: one rank
#                                     computes 1.4 times as long from step
#                                     30, another loads its data six times
#                                     as long from step 35
#   docs/hang-flamegraph-64ranks.png  the merged Python stacks of a 64-rank
#                                     job where rank 37 is still loading
#                                     data while the others wait in
#                                     all_reduce
#
# Run it from anywhere: docs/screenshots.sh
set -eu
cd "$(dirname "$0")/.."
command -v chromium >/dev/null || { echo "screenshots.sh: needs chromium (Debian package chromium)" >&2; exit 1; }
FAULTLINE_SCREENSHOTS="$PWD/docs" go test -count=1 -run '^TestHTMLInChromium$' ./trace/slownode
FAULTLINE_SCREENSHOTS="$PWD/docs" go test -count=1 -run '^TestSVGInChromium$' ./hang
ls -l docs/slownode-report.png docs/hang-flamegraph-64ranks.png
