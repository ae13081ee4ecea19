"""Write a modified copy of a GGUF (tests only): drop or change keys, drop, add or replace tensors."""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as QT
from gguf import GGUFReader, GGUFValueType, GGUFWriter


def _value(field):
    if field.types[0] == GGUFValueType.ARRAY:
        return field.contents(), GGUFValueType.ARRAY, field.types[-1]
    return field.contents(), field.types[0], None


def rewrite(src, dst, *, drop_keys=(), set_keys=None, drop_tensors=(), add_tensors=None,
            replace_tensors=None, arch=None):
    """set_keys: {key: (value, GGUFValueType[, sub_type])}; add/replace_tensors: {name: (array, QT or None)}."""
    r = GGUFReader(src)
    arch = arch or r.get_field("general.architecture").contents()
    w = GGUFWriter(dst, arch)
    set_keys = dict(set_keys or {})
    for name, field in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture" or name in drop_keys:
            continue
        if name in set_keys:
            continue
        value, vtype, sub = _value(field)
        w.add_key_value(name, value, vtype, sub_type=sub)
    for name, spec in set_keys.items():
        w.add_key_value(name, *spec)
    replace_tensors = dict(replace_tensors or {})
    for t in r.tensors:
        if t.name in drop_tensors:
            continue
        if t.name in replace_tensors:
            data, qtype = replace_tensors[t.name]
            w.add_tensor(t.name, data, raw_dtype=qtype)
            continue
        data = np.array(t.data)
        if t.tensor_type in (QT.F32, QT.F16):
            w.add_tensor(t.name, data)
        else:
            w.add_tensor(t.name, data, raw_dtype=t.tensor_type)
    for name, (data, qtype) in (add_tensors or {}).items():
        w.add_tensor(name, data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst
