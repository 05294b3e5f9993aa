//! Native pipelines are built from a kernel's shader already specialised: its `override`
//! constants applied (naga's own pass, as wgpu does it), then every `if` whose condition
//! became a constant replaced by the branch it takes, and what no longer has a use dropped.
//!
//! The kernels select their paths with boolean overrides (`WITH_RING`, `K_CHANNELS`, ...),
//! so most of an attention kernel's text is branches a given pipeline never takes. A Vulkan
//! driver is handed the whole of it otherwise: lavapipe inlines and lowers every branch
//! before it folds the constants, most of a pipeline's build there (docs/benchmarks.md).
//! Nothing that runs changes: the same statements, in the same order, on the same values.
//!
//! The browser keeps WGSL and its overrides (WebGPU takes WGSL text only, and Tint
//! specialises it itself); see [`crate::gpu::pipelines::PipelineCache`].

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, OnceLock};

use naga::valid::{Capabilities, ModuleInfo, ValidationFlags, Validator};
use naga::{Block, Expression, Function, Handle, Literal, Module, Statement};

use crate::gpu::pipelines::Family;

/// A family's module as parsed and validated, shared by every device of the process.
struct Parsed {
    module: Module,
    info: ModuleInfo,
}

impl Parsed {
    fn new(source: &str) -> Result<Self, String> {
        let module = naga::front::wgsl::parse_str(source).map_err(|e| e.to_string())?;
        let info = Validator::new(ValidationFlags::all(), Capabilities::all())
            .validate(&module)
            .map_err(|e| e.to_string())?;
        Ok(Parsed { module, info })
    }
}

/// Each family's parsed module, parsed on first use.
fn parsed(family: Family) -> Result<Arc<Parsed>, String> {
    static PARSED: OnceLock<Mutex<HashMap<Family, Arc<Parsed>>>> = OnceLock::new();
    let mut map = PARSED
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|p| p.into_inner());
    if let Some(p) = map.get(&family) {
        return Ok(p.clone());
    }
    let p = Arc::new(Parsed::new(family.source())?);
    map.insert(family, p.clone());
    Ok(p)
}

/// The module of `family` holding only entry point `entry`, with `constants` (override name,
/// value) applied and the branches they rule out removed. An error (which the shipped
/// shaders never give; `gpu/contract.rs` checks their constants) leaves the pipeline to be
/// built from WGSL, where wgpu reports it as it reports any shader error.
pub(crate) fn specialised(
    family: Family,
    entry: &str,
    constants: &[(&str, f64)],
) -> Result<Module, String> {
    specialise(&*parsed(family)?, entry, constants)
}

/// The module of `family` holding only entry point `entry`, with `constants` applied and
/// nothing else changed (naga's pass, as wgpu runs it; `gpu/contract.rs` measures this).
#[cfg(test)]
pub(crate) fn with_overrides(
    family: Family,
    entry: &str,
    constants: &[(&str, f64)],
) -> Result<Module, String> {
    overridden(&*parsed(family)?, entry, constants)
}

fn overridden(parsed: &Parsed, entry: &str, constants: &[(&str, f64)]) -> Result<Module, String> {
    let values: naga::back::PipelineConstants =
        constants.iter().map(|&(n, v)| (n.to_string(), v)).collect();
    let (module, _) = naga::back::pipeline_constants::process_overrides(
        &parsed.module,
        &parsed.info,
        Some((naga::ShaderStage::Compute, entry)),
        &values,
    )
    .map_err(|e| e.to_string())?;
    Ok(module.into_owned())
}

fn specialise(parsed: &Parsed, entry: &str, constants: &[(&str, f64)]) -> Result<Module, String> {
    let mut module = overridden(parsed, entry, constants)?;
    let known = KnownBools::of(&module);
    for (_, function) in module.functions.iter_mut() {
        take_constant_branches(function, &known);
    }
    for entry_point in module.entry_points.iter_mut() {
        take_constant_branches(&mut entry_point.function, &known);
    }
    naga::compact::compact(&mut module, naga::compact::KeepUnused::No);
    Ok(module)
}

/// The module's constants whose value is a boolean literal.
struct KnownBools(HashMap<Handle<naga::Constant>, bool>);

impl KnownBools {
    fn of(module: &Module) -> Self {
        KnownBools(
            module
                .constants
                .iter()
                .filter_map(|(h, c)| match module.global_expressions[c.init] {
                    Expression::Literal(Literal::Bool(b)) => Some((h, b)),
                    _ => None,
                })
                .collect(),
        )
    }

    /// The value of `function`'s expression `e`, when it is a known boolean.
    fn value(&self, function: &Function, e: Handle<Expression>) -> Option<bool> {
        match function.expressions[e] {
            Expression::Literal(Literal::Bool(b)) => Some(b),
            Expression::Constant(c) => self.0.get(&c).copied(),
            _ => None,
        }
    }
}

/// Replaces every `if` of `function` whose condition is a known boolean by the branch it
/// takes, and forgets the names of expressions only the removed branches evaluated.
fn take_constant_branches(function: &mut Function, known: &KnownBools) {
    let conditions: HashMap<Handle<Expression>, bool> = function
        .expressions
        .iter()
        .filter_map(|(h, _)| known.value(function, h).map(|b| (h, b)))
        .collect();
    prune(&mut function.body, &conditions);
    let mut evaluated = HashSet::new();
    evaluated_in(&function.body, &mut evaluated);
    let expressions = &function.expressions;
    function
        .named_expressions
        .retain(|h, _| evaluated.contains(h) || expressions[*h].needs_pre_emit());
}

/// `block` with every `if` on a condition in `conditions` replaced by its taken branch.
fn prune(block: &mut Block, conditions: &HashMap<Handle<Expression>, bool>) {
    let old = std::mem::take(block);
    let mut new = Block::with_capacity(old.len());
    for (statement, span) in old.span_into_iter() {
        let statement = match statement {
            Statement::If {
                condition,
                mut accept,
                mut reject,
            } => match conditions.get(&condition) {
                Some(&taken) => {
                    let mut branch = if taken { accept } else { reject };
                    prune(&mut branch, conditions);
                    Statement::Block(branch)
                }
                None => {
                    prune(&mut accept, conditions);
                    prune(&mut reject, conditions);
                    Statement::If {
                        condition,
                        accept,
                        reject,
                    }
                }
            },
            Statement::Block(mut b) => {
                prune(&mut b, conditions);
                Statement::Block(b)
            }
            Statement::Loop {
                mut body,
                mut continuing,
                break_if,
            } => {
                prune(&mut body, conditions);
                prune(&mut continuing, conditions);
                Statement::Loop {
                    body,
                    continuing,
                    break_if,
                }
            }
            Statement::Switch {
                selector,
                mut cases,
            } => {
                for case in cases.iter_mut() {
                    prune(&mut case.body, conditions);
                }
                Statement::Switch { selector, cases }
            }
            other => other,
        };
        new.push(statement, span);
    }
    *block = new;
}

/// Adds to `out` every expression `block` evaluates: emitted ranges and statement results.
fn evaluated_in(block: &Block, out: &mut HashSet<Handle<Expression>>) {
    for statement in block.iter() {
        match statement {
            Statement::Emit(range) => out.extend(range.clone()),
            Statement::Call {
                result: Some(r), ..
            }
            | Statement::Atomic {
                result: Some(r), ..
            } => {
                out.insert(*r);
            }
            Statement::WorkGroupUniformLoad { result, .. } => {
                out.insert(*result);
            }
            Statement::Block(b) => evaluated_in(b, out),
            Statement::If { accept, reject, .. } => {
                evaluated_in(accept, out);
                evaluated_in(reject, out);
            }
            Statement::Loop {
                body, continuing, ..
            } => {
                evaluated_in(body, out);
                evaluated_in(continuing, out);
            }
            Statement::Switch { cases, .. } => {
                for case in cases {
                    evaluated_in(&case.body, out);
                }
            }
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SOURCE: &str = r#"
override FLAG: bool = false;
override N: u32 = 4u;
@group(0) @binding(0) var<storage, read_write> out: array<u32>;
fn only_when_set() -> u32 { return 7u; }
@compute @workgroup_size(1) fn main() {
    var x = 0u;
    if FLAG {
        let a = only_when_set();
        x = a;
    } else {
        let b = arrayLength(&out) * N;
        x = b;
    }
    if x > 3u {
        x = x + 1u;
    }
    out[0] = x;
}
@compute @workgroup_size(1) fn other() {
    out[1] = 1u;
}
"#;

    /// The `if` statements of `block`, nested ones included.
    fn ifs(block: &Block) -> usize {
        block
            .iter()
            .map(|s| match s {
                Statement::If { accept, reject, .. } => 1 + ifs(accept) + ifs(reject),
                Statement::Block(b) => ifs(b),
                Statement::Loop {
                    body, continuing, ..
                } => ifs(body) + ifs(continuing),
                _ => 0,
            })
            .sum()
    }

    /// Either way round, the taken branch stays, the other goes (with the helper only it
    /// called, and the name of the value only it computed), the `if` on a value the
    /// constants do not fix stays, the other entry point goes, and the result validates.
    #[test]
    fn constant_branches_are_taken_and_the_rest_dropped() {
        let parsed = Parsed::new(SOURCE).unwrap();
        assert_eq!(ifs(&parsed.module.entry_points[0].function.body), 2);
        for flag in [false, true] {
            let m = specialise(&parsed, "main", &[("FLAG", f64::from(u8::from(flag)))]).unwrap();
            assert_eq!(m.entry_points.len(), 1);
            let main = &m.entry_points[0].function;
            assert_eq!(ifs(&main.body), 1, "FLAG {flag}");
            assert_eq!(m.functions.len(), usize::from(flag), "FLAG {flag}");
            let names: Vec<&str> = main
                .named_expressions
                .values()
                .map(String::as_str)
                .collect();
            assert!(names.contains(&if flag { "a" } else { "b" }), "{names:?}");
            assert!(!names.contains(&if flag { "b" } else { "a" }), "{names:?}");
            Validator::new(ValidationFlags::all(), Capabilities::all())
                .validate(&m)
                .unwrap();
        }
    }

    /// A constant the module does not declare is an error, not a panic.
    #[test]
    fn an_unknown_constant_is_an_error() {
        let parsed = Parsed::new(SOURCE).unwrap();
        assert!(specialise(&parsed, "main", &[("NOPE", 1.0)]).is_err());
    }
}
