"""The kernel library's interface is csrc/llmserve.h alone: what Python reads from it is what the compiler builds."""

import ctypes
import shutil
import subprocess

import pytest

from llmserve_torch import kernel_library

if shutil.which("g++") is None:
    pytest.skip("needs g++", allow_module_level=True)


def test_the_header_declares_exactly_what_the_library_exports():
    lib = kernel_library.load()
    if shutil.which("nm") is None:
        pytest.skip("needs nm (binutils)")
    out = subprocess.run(["nm", "-D", "--defined-only", lib._name], capture_output=True, text=True, check=True).stdout
    exported = {line.split()[-1] for line in out.splitlines() if line.split()[-1].startswith("llmserve_")}
    assert exported == set(kernel_library.api().functions)


def test_every_struct_read_from_the_header_has_the_compilers_layout(tmp_path):
    """sizeof and every field's offset, as g++ lays the header's structs out, equal the ctypes layouts."""
    structs = kernel_library.api().structs
    assert {"qlinear", "layer", "model", "scratch", "step"} <= set(structs)
    lines = []
    for name, cls in structs.items():
        lines.append(f'printf("{name} %zu\\n", sizeof(struct llmserve_{name}));')
        lines += [f'printf("{name}.{f} %zu\\n", offsetof(struct llmserve_{name}, {f}));' for f, _ in cls._fields_]
    src = tmp_path / "layout.c"
    src.write_text('#include <stddef.h>\n#include <stdio.h>\n#include "llmserve.h"\nint main(void) {\n'
                   + "\n".join(lines) + "\nreturn 0;\n}\n")
    exe = tmp_path / "layout"
    subprocess.run(["gcc" if shutil.which("gcc") else "g++", f"-I{kernel_library.CSRC}", str(src), "-o", str(exe)],
                   check=True)
    compiler = dict(line.split() for line in subprocess.run([str(exe)], capture_output=True, text=True,
                                                            check=True).stdout.splitlines())
    ours = {}
    for name, cls in structs.items():
        ours[name] = str(ctypes.sizeof(cls))
        ours.update({f"{name}.{f}": str(getattr(cls, f).offset) for f, _ in cls._fields_})
    assert ours == compiler


def test_limits_and_signatures_come_from_the_header():
    api = kernel_library.api()
    assert api.limits["INT8_MAX_ROWS"] == 8 and api.limits["GROUP_FORMAT"] == 0x100
    restype, argtypes = api.functions["llmserve_quant_bytes"]
    assert restype is ctypes.c_int64 and argtypes == [ctypes.c_int] * 3
    assert api.functions["llmserve_quant_isa"] == (ctypes.c_char_p, [])
    # a struct within a struct keeps its layout; pointers are addresses
    assert dict(api.structs["layer"]._fields_)["qkv"] is api.structs["qlinear"]
    assert dict(api.structs["qlinear"]._fields_)["scale"] is ctypes.c_void_p
