// Numbers written the way a person writes them: the same rules as numbers.py (see its
// docstring), tested on the same table of cases (tests/data/numbers.json).

const MISSING = "–";
const SUFFIXES = [[1e12, "T"], [1e9, "G"], [1e6, "M"], [1e3, "k"]];

function isMissing(v) {
  return v === null || v === undefined || !Number.isFinite(v);
}

// v with `decimals` decimals and thousands separators; ties rounded away from zero.
function fixed(v, decimals) {
  return v.toLocaleString("en-US", {
    minimumFractionDigits: decimals, maximumFractionDigits: decimals, roundingMode: "halfExpand",
  });
}

function strip(text) {
  if (text.includes(".")) text = text.replace(/0+$/, "").replace(/\.$/, "");
  return text === "-0" || text === "" ? "0" : text;
}

function significant(v, digits) {
  const decimals = Math.max(0, digits - 1 - Math.floor(Math.log10(Math.abs(v))));
  let text = fixed(v, decimals);
  if (decimals && Math.abs(Number(text.replaceAll(",", ""))) >= 10 ** (digits - decimals)) {
    text = fixed(v, decimals - 1); // rounding carried into a new digit: 9.996 -> 10.0
  }
  return strip(text);
}

// A measured value in `digits` significant digits: 1.5, 0.01, 633, 1,234, 190 k, 1.2e-4.
function number(v, digits = 3) {
  if (isMissing(v)) return MISSING;
  if (v === 0) return "0";
  const a = Math.abs(v);
  if (a >= 1e4) {
    for (const [scale, suffix] of SUFFIXES) {
      if (a >= scale * (1 - 0.5 * 10 ** -digits)) return `${significant(v / scale, digits)} ${suffix}`;
    }
  }
  if (a >= 10 ** digits) return fixed(v, 0);
  if (a < 1e-3) {
    let exponent = Math.floor(Math.log10(a));
    let mantissa = fixed(v / 10 ** exponent, digits - 1);
    if (Math.abs(Number(mantissa)) >= 10) {
      exponent += 1;
      mantissa = fixed(v / 10 ** exponent, digits - 1);
    }
    return `${strip(mantissa)}e${exponent}`;
  }
  return significant(v, digits);
}

// Something counted (steps, points): 200,000; a fractional value as number() writes it.
function count(v) {
  if (isMissing(v)) return MISSING;
  return Number.isInteger(v) ? fixed(v, 0) : number(v);
}

// Axis labels: as short as number() makes them, but never two alike.
function tickLabels(values) {
  let labels = [];
  for (let digits = 3; digits < 10; digits++) {
    labels = values.map((v) => number(v, digits));
    if (new Set(labels).size === labels.length) break;
  }
  return labels;
}

// A duration in seconds as 0:42, 12:05 or 1:02:03.
function duration(s) {
  if (isMissing(s)) return MISSING;
  s = Math.round(s);
  const h = Math.floor(s / 3600), m = Math.floor((s % 3600) / 60), sec = s % 60;
  const pad = (x) => String(x).padStart(2, "0");
  return h ? `${h}:${pad(m)}:${pad(sec)}` : `${m}:${pad(sec)}`;
}
