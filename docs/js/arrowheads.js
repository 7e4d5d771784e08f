// The theme colours a sequence diagram's arrowheads by the id mermaid 10 gave their markers
// (#arrowhead, #crosshead); mermaid 11 prefixes it with the diagram's own (__mermaid_0-arrowhead),
// so they kept mermaid's default, #333: invisible on the dark theme's slate, who sends to whom
// lost. Each diagram is drawn in a closed shadow root that the site's CSS cannot reach, but
// its own style sheet is the theme's `themeCSS`: the same rules, matching the end of the id,
// are added there. The colours are the theme's custom properties, which reach inside.
(() => {
  const rules =
    'marker[id$="-arrowhead"] path {' +
    " fill: var(--md-mermaid-sequence-message-line-color); stroke: none; }" +
    'marker[id$="-crosshead"] path {' +
    " fill: none; stroke: var(--md-mermaid-sequence-message-line-color); }";
  const initialize = mermaid.initialize.bind(mermaid);
  mermaid.initialize = (config) =>
    initialize({ ...config, themeCSS: (config.themeCSS || "") + rules });
})();
