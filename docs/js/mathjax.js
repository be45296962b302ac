// MathJax 3 set-up for pymdownx.arithmatex (generic mode), which wraps $…$ as \(…\) and
// $$…$$ as \[…\] inside elements of class "arithmatex"; only those elements are typeset.
// MathJax itself ships with the site (assets/mathjax/, copied by docs/hooks.py).
window.MathJax = {
  tex: {inlineMath: [["\\(", "\\)"]], displayMath: [["\\[", "\\]"]],
        processEscapes: true, processEnvironments: true},
  options: {ignoreHtmlClass: ".*|", processHtmlClass: "arithmatex"},
  startup: {typeset: true}
};
